"""a4's Qwen3.5 against transformers' Qwen3_5ForConditionalGeneration, logits for logits.

The ForwardBatches are built by hand (`a4.course.checks._model_runner`): a KV pool holding only the full-attention
layers, a zero-initialised stand-in for the state pool of the Gated DeltaNet layers (the real StatePool is notebook
05's), a request-slot table and KV locations handed out in random order. Checked: one request's prefill and ten
decode steps (and its greedy tokens against `generate`), a flattened batch of three requests of different lengths
with one prefilled in two chunks, config shapes other than the tiny default, and a bfloat16 report.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from torch.nn.attention import sdpa_kernel

from a4.checkpoints import tiny_checkpoint
from a4.course.checks import deltanet as checks
from a4.course.checks._harness import assert_close, model_reduction_length, random_tokens, tolerance
from a4.course.checks._model_runner import ModelRunner, a4_model
from a4.layers.attention import SDPA_BACKENDS
from a4.reference import cached_hf_model

MAX_CONTEXT = 128
NUM_SLOTS = 4
# bfloat16: a floor, not a target; the measured figures are printed (pytest -s). Near-ties between the top two
# logits of a random tiny model flip under bfloat16 rounding, so agreement is not 100%.
BF16_MIN_ARGMAX_AGREEMENT = 0.9

# Shapes the tiny default does not have. tiny: 2 key heads, 4 value heads, kernel 4, layers [gdn x3, full] x 2.
OTHER_SHAPES = {
    "kernel 2, value heads 3x key heads, odd MLP, untied": dict(
        linear_conv_kernel_dim=2, linear_num_value_heads=6, intermediate_size=97, tie_word_embeddings=False
    ),
    "kernel 3, full attention first": dict(
        linear_conv_kernel_dim=3,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ),
}


@functools.cache
def hf_sdpa_model(checkpoint, dtype: torch.dtype):
    # transformers' default attention, "sdpa", calls the kernel a4's paged attention calls: in bfloat16 the two then
    # round alike (a4.reference's models use "eager", whose bfloat16 roundings differ a little more).
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        checkpoint, dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """A transformers model's float32 logits [n, vocab] for every position of one sequence, no cache; its SDPA
    (if it uses any) limited to the kernels a4's attention may use."""
    with torch.no_grad(), sdpa_kernel(SDPA_BACKENDS):
        return model(torch.tensor([tokens])).logits[0].float()


def test_prefill_and_ten_decode_steps_float32():
    checks.check_model_logits()


def run_varlen_batch(model, vocab: int) -> dict[int, tuple[list[int], torch.Tensor]]:
    """Three requests in one flat batch, in slots 3, 0 and 1; the third prefilled in two chunks (the first chunk not
    sampled); then three decode steps of all three. Slots 3 and 0 first serve other requests, whose states stay
    behind. Returns, per slot, its tokens and the logits of every token fed in a sampled step (NaN rows where
    nothing was sampled)."""
    runner = ModelRunner(model, NUM_SLOTS, MAX_CONTEXT)
    runner.forward({3: random_tokens(9, 30, vocab), 0: random_tokens(4, 31, vocab)})
    runner.release(3)
    runner.release(0)
    prompts = {3: random_tokens(5, 10, vocab), 0: random_tokens(23, 11, vocab), 1: random_tokens(70, 12, vocab)}
    decode_tokens = {slot: random_tokens(3, 20 + slot, vocab) for slot in prompts}
    logits = {slot: [] for slot in prompts}
    # Step 1: two whole prompts and the first chunk of the long one, which samples nothing.
    first_chunk = 40
    step = runner.forward(
        {3: prompts[3], 0: prompts[0], 1: prompts[1][:first_chunk]}, sample={3: True, 0: True, 1: False}
    )
    logits[3].append(step[3])
    logits[0].append(step[0])
    logits[1].append(torch.full((first_chunk, step[3].shape[1]), float("nan")))
    # Step 2: the rest of the long prompt, continuing its KV and its GDN state.
    logits[1].append(runner.forward({1: prompts[1][first_chunk:]})[1])
    for i in range(3):
        step = runner.forward({slot: [decode_tokens[slot][i]] for slot in prompts})
        for slot in prompts:
            logits[slot].append(step[slot])
    return {slot: (prompts[slot] + decode_tokens[slot], torch.cat(logits[slot])) for slot in prompts}


def assert_varlen_batch_matches(checkpoint) -> None:
    model = a4_model(checkpoint, torch.float32)
    for slot, (tokens, logits) in run_varlen_batch(model, model.config.vocab_size).items():
        sampled = ~logits.isnan().any(dim=1)
        reference = hf_logits(cached_hf_model(checkpoint, torch.float32), tokens)
        allowed = tolerance(torch.float32, model_reduction_length(model.config, len(tokens)))
        assert_close(logits[sampled], reference[sampled], allowed, f"logits of slot {slot}")


def test_varlen_batch_equals_each_request_alone_float32(tiny_qwen3_5):
    assert_varlen_batch_matches(tiny_qwen3_5)


@pytest.mark.parametrize("overrides", OTHER_SHAPES.values(), ids=OTHER_SHAPES.keys())
def test_other_config_shapes_float32(overrides):
    assert_varlen_batch_matches(tiny_checkpoint("qwen3_5", **overrides))


def test_bfloat16_report(tiny_qwen3_5):
    """a4 in bfloat16 against transformers in bfloat16, measured against bfloat16's own rounding noise (transformers
    in bfloat16 against transformers in float32): a4 may differ from the reference by no more than that noise."""
    checkpoint = tiny_qwen3_5
    model = a4_model(checkpoint, torch.bfloat16)
    agree = total = 0
    error = noise = 0.0
    for tokens, logits in run_varlen_batch(model, model.config.vocab_size).values():
        sampled = ~logits.isnan().any(dim=1)
        ours = logits[sampled]
        reference = hf_logits(hf_sdpa_model(checkpoint, torch.bfloat16), tokens)[sampled]
        exact = hf_logits(cached_hf_model(checkpoint, torch.float32), tokens)[sampled]
        error = max(error, (ours - reference).abs().max().item())
        noise = max(noise, (reference - exact).abs().max().item())
        agree += (ours.argmax(dim=1) == reference.argmax(dim=1)).sum().item()
        total += len(ours)
    print(
        f"\nbfloat16: argmax agrees with transformers on {agree}/{total} tokens; max |logit diff| {error:.3g}, "
        f"against {noise:.3g} between transformers in bfloat16 and in float32"
    )
    assert agree / total >= BF16_MIN_ARGMAX_AGREEMENT
    assert error <= noise


def test_missing_state_pool_is_a_clear_error(tiny_qwen3_5):
    runner = ModelRunner(a4_model(tiny_qwen3_5, torch.float32), NUM_SLOTS, MAX_CONTEXT)
    runner.states = None
    with pytest.raises(ValueError, match="state_pool"):
        runner.forward({0: [1, 2, 3]})
