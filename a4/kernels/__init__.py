"""a4's own GPU kernels (Triton) for the decode path and prefill attention, and the GPU prefill of the Gated DeltaNet
layers.

- `gdn_decode`: the GDN decode step in place by state slot (`conv_update_by_slot_`,
  `gated_delta_rule_update_by_slot_`), one read and one write of each state row, capturable in a CUDA graph; the
  same kernels over a verify pass's L tokens, keeping the state after each (`..._verify_by_slot_`);
- `paged_attention`: decode attention over the paged KV pool (`paged_decode_attention`), split over the context;
- `extend_attention`: prefill attention, every request of the step in one launch, a cached prefix read in place;
- `fla_prefill`: the varlen GDN prefill through flash-linear-attention, gathered from and written back to the pool;
- `rmsnorm`: the zero-centred and gated RMSNorms in one kernel each, the residual add folded into the first;
- `activation`: SwiGLU's SiLU-and-multiply, and gated attention's output gate, in one kernel each;
- `rope`: a gated attention layer's q/k norms, partial RoPE and KV write in one kernel;
- `gemv`: linear layers of at most four rows (decode at small batches, a batch-1 verify), each row the same bits
  whatever rows share its call;
- `moe`: the routed experts over the token-expert pairs grouped on the device, and the router in one program;
- `greedy`: the sampler's argmax and its check that the logits are finite, in one read of the logits;
- `pdl`: programmatic dependent launch, the next kernel of a step launched while this one ends (Hopper and later).

Triton and flash-linear-attention are GPU extras: nothing here is imported by `import a4.kernels`, so the CPU
engine, its tests and the notebooks run without them. Import the module you need where CUDA is in use.
"""

import importlib.util

import torch

# The kernel packages transformers takes, where they can be imported, instead of its own torch Gated DeltaNet and
# conv code (flash-linear-attention is also a4's GPU prefill). a4.reference refuses to run beside them; `bench gpu`
# and the GPU tests block them where transformers must run its own code. Named here, in a module that imports
# neither, because importing a4.reference already checks for them.
TRANSFORMERS_KERNEL_PACKAGES = ("fla", "causal_conv1d")


def triton_kernels_run_on(device: torch.device) -> bool:
    """Whether a4's Triton kernels can serve tensors on `device`: a CUDA device, with Triton installed (torch's CUDA
    wheels bring it). Looks for the package without importing it."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
