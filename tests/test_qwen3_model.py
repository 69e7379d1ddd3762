"""a4's Qwen3 against transformers' Qwen3, logits for logits.

The ForwardBatches are built by hand here (a request-slot table and scattered KV locations), so that the model is
checked on its own, before any scheduler exists: a whole prompt, a prefill then decode steps, and a flattened batch
of requests of different lengths, one of them prefilled in two chunks.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from a4.checkpoints import tiny_checkpoint
from a4.core import ForwardBatch
from a4.kvcache.kv_pool import KVPool
from a4.models.registry import load_model

MAX_CONTEXT = 64
NUM_SLOTS = 4
# float32: a4 and transformers differ only in the order of float32 roundings.
FP32_RELATIVE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("qwen3")


@functools.cache
def a4_model(checkpoint, dtype: torch.dtype):
    return load_model(checkpoint, dtype=dtype, device="cpu", progress=False)[1]


@functools.cache
def hf_model(checkpoint, dtype: torch.dtype):
    # "sdpa" is transformers' default attention and the kernel a4 calls: in bfloat16 the two then round alike.
    model = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class PagedRunner:
    """Drives the model like an engine would: a KV pool, a request-slot table, locations handed out at random."""

    def __init__(self, model, seed: int = 0) -> None:
        config = model.config
        self.model = model
        dtype = model.lm_head.weight.dtype
        self.pool = KVPool(config.num_hidden_layers, 64, 4, config.num_key_value_heads, config.head_dim, dtype, "cpu")
        gen = torch.Generator().manual_seed(seed)
        self.free_locations = torch.randperm(self.pool.num_locations, generator=gen).tolist()
        self.req_to_token = torch.zeros(NUM_SLOTS, MAX_CONTEXT, dtype=torch.long)
        self.lens = [0] * NUM_SLOTS

    def forward(
        self, new_tokens: dict[int, list[int]], sample: dict[int, bool] | None = None
    ) -> dict[int, torch.Tensor]:
        """Feed new_tokens[slot] to each slot's request; logits [n, vocab] of every new token of each sampled slot."""
        slots = list(new_tokens)
        sample = sample or {slot: True for slot in slots}
        prefix_lens = [self.lens[slot] for slot in slots]
        extend_lens = [len(new_tokens[slot]) for slot in slots]
        out_cache_loc, sample_indices, row = [], [], 0
        for slot, prefix_len, extend_len in zip(slots, prefix_lens, extend_lens):
            locations = [self.free_locations.pop() for _ in range(extend_len)]
            self.req_to_token[slot, prefix_len : prefix_len + extend_len] = torch.tensor(locations)
            self.lens[slot] += extend_len
            out_cache_loc += locations
            if sample[slot]:
                sample_indices += range(row, row + extend_len)
            row += extend_len
        fb = ForwardBatch(
            phase="decode" if all(n == 1 for n in extend_lens) and all(prefix_lens) else "prefill",
            input_ids=torch.tensor([t for slot in slots for t in new_tokens[slot]]),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)]),
            req_slots=torch.tensor(slots),
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            out_cache_loc=torch.tensor(out_cache_loc),
            sample_indices=torch.tensor(sample_indices, dtype=torch.long),
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
        )
        with torch.no_grad():
            logits = self.model(fb)
        assert logits.dtype == torch.float32 and logits.shape == (len(sample_indices), self.model.config.vocab_size)
        per_slot, start = {}, 0
        for slot, extend_len in zip(slots, extend_lens):
            if sample[slot]:
                per_slot[slot] = logits[start : start + extend_len]
                start += extend_len
        return per_slot


def random_tokens(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(checkpoint, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [n, vocab] for every position of one sequence, no cache."""
    with torch.no_grad():
        return hf_model(checkpoint, dtype)(torch.tensor([tokens])).logits[0].float()


def assert_fp32_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= FP32_RELATIVE_TOLERANCE * scale, f"max abs diff {err:.3g} at logit scale {scale:.3g}"


def test_full_prompt_logits_float32(checkpoint):
    prompt = random_tokens(40, seed=1)
    logits = PagedRunner(a4_model(checkpoint, torch.float32)).forward({2: prompt})[2]
    assert_fp32_close(logits, hf_logits(checkpoint, torch.float32, prompt))


def test_full_prompt_logits_bfloat16(checkpoint):
    # Same cast points and the same SDPA kernel as transformers' sdpa path: bfloat16 logits agree exactly.
    prompt = random_tokens(40, seed=2)
    logits = PagedRunner(a4_model(checkpoint, torch.bfloat16)).forward({0: prompt})[0]
    assert torch.equal(logits, hf_logits(checkpoint, torch.bfloat16, prompt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_matches_transformers_incremental(checkpoint, dtype):
    """Greedy decoding both ways, a4 following transformers' tokens; logits compared at every step."""
    prompt = random_tokens(11, seed=3)
    runner = PagedRunner(a4_model(checkpoint, dtype), seed=3)
    hf = hf_model(checkpoint, dtype)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt]), use_cache=True)
        ours = runner.forward({1: prompt})[1]
        for _ in range(6):
            ref_logits = reference.logits[0].float()
            if dtype == torch.float32:
                assert_fp32_close(ours, ref_logits)
            else:
                assert torch.equal(ours, ref_logits)
            token = int(ref_logits[-1].argmax())
            reference = hf(torch.tensor([[token]]), cache=reference.cache, use_cache=True)
            ours = runner.forward({1: [token]})[1]


def test_flattened_batch_with_chunked_prefill_matches_each_request_alone(checkpoint):
    """Three requests of different lengths share every step; B's prompt arrives in two chunks."""
    runner = PagedRunner(a4_model(checkpoint, torch.float32), seed=4)
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
        reference = hf_logits(checkpoint, torch.float32, seq[:length])
        assert_fp32_close(torch.cat(got[slot]), reference[start:])
