"""a4's Qwen3 against transformers' Qwen3, logits for logits.

The ForwardBatches are built by hand (`a4.course.checks._model_runner`: a request-slot table and scattered KV
locations), so that the model is checked on its own, before any scheduler exists: a whole prompt, a prefill then
decode steps, and a flattened batch of requests of different lengths, one of them prefilled in two chunks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch.nn.attention import sdpa_kernel

from a4.course.checks._harness import assert_close, model_reduction_length, random_tokens, tolerance
from a4.course.checks._model_runner import ModelRunner, a4_model
from a4.layers.attention import SDPA_BACKENDS

MAX_CONTEXT = 64
NUM_SLOTS = 4


@functools.cache
def hf_model(checkpoint, dtype: torch.dtype):
    # "sdpa" is transformers' default attention and the kernel a4 calls: in bfloat16 the two then round alike.
    model = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def hf_forward(model, *args, **kwargs):
    """A transformers forward whose SDPA may use the kernels a4's attention may use, and no other."""
    with torch.no_grad(), sdpa_kernel(SDPA_BACKENDS):
        return model(*args, **kwargs)


def hf_logits(checkpoint, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [n, vocab] for every position of one sequence, no cache."""
    return hf_forward(hf_model(checkpoint, dtype), torch.tensor([tokens])).logits[0].float()


def float32_tolerance(model, context: int) -> float:
    return tolerance(torch.float32, model_reduction_length(model.config, context))


def test_full_prompt_logits_float32(tiny_qwen3):
    prompt = random_tokens(40, seed=1)
    model = a4_model(tiny_qwen3, torch.float32)
    logits = ModelRunner(model, NUM_SLOTS, MAX_CONTEXT).forward({2: prompt})[2]
    assert_close(logits, hf_logits(tiny_qwen3, torch.float32, prompt), float32_tolerance(model, len(prompt)))


def test_full_prompt_logits_bfloat16(tiny_qwen3):
    # Bit for bit: the same operations on the same shapes, with the same casts and the same SDPA kernel as
    # transformers' sdpa path, run the same kernels on any CPU, which round alike.
    prompt = random_tokens(40, seed=2)
    logits = ModelRunner(a4_model(tiny_qwen3, torch.bfloat16), NUM_SLOTS, MAX_CONTEXT).forward({0: prompt})[0]
    assert torch.equal(logits, hf_logits(tiny_qwen3, torch.bfloat16, prompt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_matches_transformers_incremental(tiny_qwen3, dtype):
    """Greedy decoding both ways, a4 following transformers' tokens; logits compared at every step."""
    prompt = random_tokens(11, seed=3)
    model = a4_model(tiny_qwen3, dtype)
    runner = ModelRunner(model, NUM_SLOTS, MAX_CONTEXT, seed=3)
    hf = hf_model(tiny_qwen3, dtype)
    reference = hf_forward(hf, torch.tensor([prompt]), use_cache=True)
    ours = runner.forward({1: prompt})[1]
    for step in range(6):
        ref_logits = reference.logits[0].float()
        if dtype == torch.float32:
            assert_close(ours, ref_logits, float32_tolerance(model, len(prompt) + step), f"step {step}")
        else:
            # Bit for bit, as the whole prompt's logits above (decode folds GQA into rows of queries, which on
            # these shapes rounds alike too).
            assert torch.equal(ours, ref_logits)
        token = int(ref_logits[-1].argmax())
        reference = hf_forward(hf, torch.tensor([[token]]), cache=reference.cache, use_cache=True)
        ours = runner.forward({1: [token]})[1]


def test_flattened_batch_with_chunked_prefill_matches_each_request_alone(tiny_qwen3):
    """Three requests of different lengths share every step; B's prompt arrives in two chunks."""
    model = a4_model(tiny_qwen3, torch.float32)
    runner = ModelRunner(model, NUM_SLOTS, MAX_CONTEXT, seed=4)
    sequences = {0: random_tokens(20, seed=10), 3: random_tokens(30, seed=11), 1: random_tokens(16, seed=12)}
    prompt_lens = {0: 5, 3: 17, 1: 9}
    got: dict[int, list[torch.Tensor]] = {slot: [] for slot in sequences}

    def record(logits: dict[int, torch.Tensor]) -> None:
        for slot, rows in logits.items():
            got[slot].append(rows)

    a, b, c = sequences[0], sequences[3], sequences[1]
    # Step 1: A's whole prompt; B's first chunk (no token sampled for it: its prompt is not finished).
    record(runner.forward({0: a[:5], 3: b[:10]}, sample={0: True, 3: False}))
    # Step 2: B's second chunk, attending to its first chunk through the pool, next to C's whole prompt.
    record(runner.forward({3: b[10:17], 1: c[:9]}))
    # Decode steps: each request at its own length.
    for step in range(4):
        record(runner.forward({slot: [seq[prompt_lens[slot] + step]] for slot, seq in sequences.items()}))

    for slot, seq in sequences.items():
        start = 0 if slot != 3 else 10  # B's first chunk was not sampled
        length = start + sum(len(rows) for rows in got[slot])
        reference = hf_logits(tiny_qwen3, torch.float32, seq[:length])
        assert_close(torch.cat(got[slot]), reference[start:], float32_tolerance(model, length), f"slot {slot}")
