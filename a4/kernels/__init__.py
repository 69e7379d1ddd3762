"""a4's own GPU kernels (Triton) for the decode path, and the GPU prefill of the Gated DeltaNet layers.

- `gdn_decode`: the GDN decode step in place by state slot (`conv_update_by_slot_`,
  `gated_delta_rule_update_by_slot_`), one read and one write of each state row, capturable in a CUDA graph;
- `paged_attention`: decode attention over the paged KV pool (`paged_decode_attention`), split over the context;
- `fla_prefill`: the varlen GDN prefill through flash-linear-attention, gathered from and written back to the pool.

Triton and flash-linear-attention are GPU extras: nothing here is imported by `import a4.kernels`, so the CPU
engine, its tests and the notebooks run without them. Import the module you need where CUDA is in use.
"""
