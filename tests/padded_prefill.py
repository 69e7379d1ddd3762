"""A padded prefill (the static-buffer runner's EXTEND step) against an eager prefill of the same prompt: the check
that tests/test_graph_runner.py runs on the CPU and tests/test_gpu.py on CUDA, where the padded prefill is captured."""

from __future__ import annotations

import torch

from a4 import LLM, SamplingParams


def assert_a_padded_prefill_leaves_no_trace(ckpt, prompt: list[int], device: str, dtype: torch.dtype) -> None:
    """The padding after the prompt must leave no trace: the request's conv and recurrent states and the KV it
    writes equal an eager prefill's (the same backends over the prompt alone), and no KV location but the padding
    slot's changes besides the request's. The slot served a longer prompt first, whose pages the prefix cache keeps:
    the table row's entries past the new prompt still point at them, and the padding must not write there."""
    occupant = [(token + 1) % 1000 for token in prompt] + list(range(40))  # longer, and no prefix in common
    traces = {}
    for padded in (True, False):
        llm = LLM(ckpt, device=device, dtype=dtype, cuda_graphs=True, max_running_requests=1, max_prefill_tokens=32)
        engine = llm.engine
        runner = engine.graph_runner
        if not padded:
            runner.takes_prefill = lambda prefix_lens, extend_lens: False
        llm.generate([occupant], SamplingParams(max_new_tokens=1))
        kv_layers = range(engine.kv_pool.num_layers)
        kv_before = [torch.stack(engine.kv_pool.get_kv(layer)).clone() for layer in kv_layers]
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
        engine.step()  # the prefill, and the first token
        slot, gdn_layers = req.slot, range(len(engine.model_config.linear_attention_layers))
        locations = engine.table_manager.req_to_token[slot, : len(prompt)]
        stale = engine.table_manager.req_to_token[slot, len(prompt) : len(occupant)].tolist()
        assert set(stale).isdisjoint(locations.tolist()) and engine.cache_manager.prefix_cache.evictable_size > 0
        kv_after = [torch.stack(engine.kv_pool.get_kv(layer)) for layer in kv_layers]
        traces[padded] = {
            "conv": [engine.state_pool.conv_state(layer)[slot].float() for layer in gdn_layers],
            "recurrent": [engine.state_pool.recurrent_state(layer)[slot].clone() for layer in gdn_layers],
            "kv": [after[:, locations].float() for after in kv_after],
            "first token": req.output_ids[:1],
        }
        changed = set()
        for before, after in zip(kv_before, kv_after):
            changed |= set((before != after).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
        assert changed <= {*locations.tolist(), int(engine.table_manager.req_to_token[runner.padding_slot, 0])}
    padded, eager = traces[True], traces[False]
    # To the dtype's rounding, relative to each tensor's scale: a GEMM over the bucket's 16 rows may round otherwise
    # than over a prompt of 1 to 3, and the difference grows a little from layer to layer.
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for name in ("conv", "recurrent", "kv"):
        for ours, theirs in zip(padded[name], eager[name]):
            torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * float(theirs.abs().max()))
    if dtype == torch.float32:  # in bfloat16 one rounding may flip a token of random weights
        assert padded["first token"] == eager["first token"]
