"""The static-buffer decode runner (a4/engine/graph_runner.py) on the CPU, where it runs without capture.

`cuda_graphs=True` on the CPU runs the GPU's decode path eagerly: static buffers, batches padded to their bucket with
a padding slot and page, attention up to the context bound, GDN states updated by slot in place. Every token must
equal transformers' greedy generation (single prompts, batches between bucket sizes, chunked prefill before decode,
slot reuse, prefix-cache hits), the padding slot and page must stay out of every request's hands, and the decode
forward must trace without a graph break (the CPU's stand-in for "can be captured").
"""

from __future__ import annotations

import random

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.core import ForwardMode
from a4.engine.forward_batch import build_forward_batch
from a4.engine.graph_runner import MAX_CAPTURED_PREFILL, batch_buckets, token_buckets
from a4.reference import hf_greedy
from padded_prefill import assert_a_padded_prefill_leaves_no_trace

MAX_NEW = 8
_rng = random.Random(7)
# Ids below 1000: the tiny checkpoints' stop tokens never appear inside a prompt.
PROMPTS = [[_rng.randrange(1000) for _ in range(n)] for n in (1, 3, 17, 40, 70, 9, 33)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request, tiny_qwen3, tiny_qwen3_5):
    ckpt = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[request.param]
    return ckpt, hf_greedy(ckpt, PROMPTS, MAX_NEW)


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112]
    for max_batch in range(1, 200):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= max_batch > (buckets[-2] if len(buckets) > 1 else 0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_static_decode_equals_transformers(model, page_size):
    ckpt, reference = model
    # 5 slots for 7 prompts: batches of 5, 4 and 3 rows padded to buckets of 8 and 4, slots reused; prompts of 40
    # and 70 tokens prefill in chunks of 32.
    llm = LLM(ckpt, cuda_graphs=True, max_running_requests=5, max_prefill_tokens=32, page_size=page_size)
    runner = llm.engine.graph_runner
    assert runner is not None and runner.buckets == [1, 2, 4, 8] and not runner.graphs
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == reference
    assert llm.stats.decode_steps > 0
    assert_padding_is_nobodys(llm)


def test_static_decode_after_prefix_hits_equals_transformers(model):
    ckpt, reference = model
    # Prefill in chunks of 16: a Qwen3.5 prompt can only resume where a state checkpoint was kept, at a chunk
    # boundary (its own end is never a hit: its last token must be fed again to get logits).
    llm = LLM(ckpt, cuda_graphs=True, max_running_requests=3, max_prefill_tokens=16)
    llm.generate(PROMPTS[3:5], SamplingParams(max_new_tokens=MAX_NEW))
    # The same prompts again, beside a new one: the repeats resume from the cache, then decode in one padded batch
    # of 3 rows (bucket 4) with the new one.
    outputs = llm.generate(PROMPTS[2:5], SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == reference[2:5]
    assert all(out.cached_tokens > 0 for out in outputs[1:])
    assert_padding_is_nobodys(llm)


def assert_padding_is_nobodys(llm: LLM) -> None:
    """The padding slot is never free (so no request gets it) and its KV page is neither free nor cached."""
    engine = llm.engine
    padding_slot = engine.graph_runner.padding_slot
    assert padding_slot not in engine.table_manager._free_slots
    assert engine.table_manager.available_size == llm.memory_plan.max_running_requests
    padding_page = int(engine.table_manager.req_to_token[padding_slot, 0]) // engine.config.page_size
    allocator = engine.cache_manager.allocator
    assert allocator._owners[padding_page] > 0
    cache = engine.cache_manager.prefix_cache
    assert cache.protected_size == 0
    assert allocator.num_free_pages + cache.evictable_size // engine.config.page_size == llm.memory_plan.num_pages


def test_the_decode_step_traces_without_a_graph_break(model):
    ckpt, _ = model
    runner = LLM(ckpt, cuda_graphs=True, max_running_requests=3).engine.graph_runner
    torch._dynamo.reset()
    with torch.inference_mode():
        explanation = torch._dynamo.explain(runner._forward)(ForwardMode.DECODE, 2)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_cuda_graphs_need_cuda_and_a_bool(tiny_qwen3):
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        LLM(tiny_qwen3, cuda_graphs="yes")
    assert LLM(tiny_qwen3).engine.graph_runner is None  # the CPU's default: plain eager decode


def test_attention_metadata_is_prepared_once_per_step(tiny_qwen3_5, monkeypatch):
    # The context is built once per step and every attention layer reads it: its metadata is never rebuilt per layer.
    from a4.layers.attention import TorchAttnBackend

    llm = LLM(tiny_qwen3_5, max_prefill_tokens=16)
    prepared = []
    original = TorchAttnBackend.prepare
    monkeypatch.setattr(TorchAttnBackend, "prepare", lambda self, fb: prepared.append(fb.mode) or original(self, fb))
    llm.generate([PROMPTS[3]], SamplingParams(max_new_tokens=4))
    stats = llm.stats
    assert len(llm.engine.model_config.full_attention_layers) > 1
    # 40 prompt tokens in chunks of 16: 3 prefill steps, then 3 decode steps (the first token comes with the prefill).
    assert prepared == [ForwardMode.EXTEND] * stats.prefill_steps + [ForwardMode.DECODE] * stats.decode_steps


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "mode"),
    [([5, 9], [1, 1], "DECODE"), ([0, 9], [1, 1], "EXTEND"), ([5, 9], [1, 2], "EXTEND"), ([0], [7], "EXTEND"),
     ([5, 9], [3, 3], "TARGET_VERIFY")],
)  # fmt: skip
def test_the_step_is_of_the_mode_given_and_writes_where_the_table_says(prefix_lens, extend_lens, mode):
    table = torch.arange(2 * 16).reshape(2, 16)
    fb = build_forward_batch(
        ForwardMode[mode], input_ids=[0] * sum(extend_lens), slots=[1, 0][: len(prefix_lens)],
        prefix_lens=prefix_lens, extend_lens=extend_lens, sample_indices=[], req_to_token=table, kv_pool=None,
    )  # fmt: skip
    assert fb.mode is ForwardMode[mode]
    positions = [p for start, n in zip(prefix_lens, extend_lens) for p in range(start, start + n)]
    slots = [s for s, n in zip([1, 0], extend_lens) for _ in range(n)]
    assert fb.out_cache_loc.tolist() == [16 * s + p for s, p in zip(slots, positions)]
    assert fb.seq_lens.tolist() == [p + n for p, n in zip(prefix_lens, extend_lens)]
    assert fb.cu_seqlens.tolist() == [sum(extend_lens[:i]) for i in range(len(extend_lens) + 1)]


@pytest.mark.parametrize(
    ("mode", "prefix_lens", "extend_lens", "num_decodes"),
    [("DECODE", [0, 9], [1, 1], 0), ("DECODE", [5, 9], [1, 2], 0), ("TARGET_VERIFY", [5, 9], [2, 3], 0),
     ("MIXED", [0, 9], [3, 2], 1), ("MIXED", [0, 0], [3, 1], 1), ("MIXED", [0, 9], [3, 1], 0),
     ("MIXED", [5, 9], [1, 1], 2), ("EXTEND", [0, 9], [3, 1], 1)],
)  # fmt: skip
def test_a_step_that_does_not_fit_its_mode_is_refused(mode, prefix_lens, extend_lens, num_decodes):
    # A decode step is one token after a prefix for every request, a verify step the same count for every request,
    # a mixed step prompts and then at least one decode (and only a mixed step has decodes after its prompts).
    table = torch.arange(2 * 16).reshape(2, 16)
    with pytest.raises(ValueError, match=mode):
        build_forward_batch(
            ForwardMode[mode], input_ids=[0] * sum(extend_lens), slots=[1, 0], prefix_lens=prefix_lens,
            extend_lens=extend_lens, sample_indices=[], req_to_token=table, kv_pool=None, num_decodes=num_decodes,
        )  # fmt: skip


def test_a_mixed_step_is_an_extend_and_a_decode_for_its_backend():
    # Two prompts (one after a prefix), then two decodes: the backend's two contexts are those the builder makes of
    # each part alone.
    table = torch.arange(4 * 16).reshape(4, 16)
    slots, prefix_lens, extend_lens = [2, 0, 3, 1], [0, 4, 7, 9], [3, 2, 1, 1]
    fb = build_forward_batch(
        ForwardMode.MIXED, input_ids=list(range(7)), slots=slots, prefix_lens=prefix_lens, extend_lens=extend_lens,
        sample_indices=[2, 4, 5, 6], req_to_token=table, kv_pool=None, num_decodes=2,
    )  # fmt: skip
    assert fb.mode is ForwardMode.MIXED and fb.mode.is_extend()
    backend = fb.attn_backend
    for part, mode, reqs, rows in ((backend.prefill, ForwardMode.EXTEND, slice(0, 2), slice(0, 5)),
                                   (backend.decode, ForwardMode.DECODE, slice(2, 4), slice(5, 7))):  # fmt: skip
        alone = build_forward_batch(
            mode, input_ids=list(range(7))[rows], slots=slots[reqs], prefix_lens=prefix_lens[reqs],
            extend_lens=extend_lens[reqs], sample_indices=[], req_to_token=table, kv_pool=None,
        )  # fmt: skip
        assert part.mode is mode
        for name in ("input_ids", "positions", "slots", "seq_lens", "cu_seqlens", "out_cache_loc", "state_slots"):
            assert getattr(part, name).tolist() == getattr(alone, name).tolist(), name
        assert (part.max_seq_len, part.extend_lens, part.prefix_lens) == (alone.max_seq_len, alone.extend_lens,
                                                                         alone.prefix_lens)  # fmt: skip
        assert type(part.attn_metadata) is type(alone.attn_metadata)


@pytest.mark.parametrize("page_size", [1, 4])
def test_static_prefill_equals_transformers(model, page_size, monkeypatch):
    # One slot: every prompt's first prefill is one request's with no prefix, the runner's. Prompts of 1 to 70
    # tokens pad to buckets of 16 and 32 (the first chunks of 32 fill theirs); those over 32 continue in eager
    # chunks.
    ckpt, reference = model
    llm = LLM(ckpt, cuda_graphs=True, max_running_requests=1, max_prefill_tokens=32, page_size=page_size)
    runner = llm.engine.graph_runner
    assert runner.extend_buckets == [16, 32]
    served = []
    original = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda ids, slot: served.append(len(ids)) or original(ids, slot))
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == reference
    # Each prompt's first prefill step, however the scheduler cut the prompt (a hybrid model's checkpointing
    # prefix cache also ends a chunk at the last page boundary, to keep a state there).
    assert len(served) == len(PROMPTS) and all(n <= min(len(p), 32) for n, p in zip(served, PROMPTS))
    assert_padding_is_nobodys(llm)


def test_token_buckets_cover_every_prefill_length():
    assert token_buckets(32) == [16, 32] and token_buckets(100) == [16, 32, 64, 100] and token_buckets(8) == [8]
    for max_tokens in range(1, 300):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        for n in range(1, max_tokens + 1):
            bucket = next(b for b in buckets if b >= n)
            assert bucket <= max(16, 2 * n - 1) or bucket == max_tokens


def test_prefills_past_the_largest_bucket_stay_eager(tiny_qwen3):
    llm = LLM(tiny_qwen3, cuda_graphs=True, max_prefill_tokens=8192)
    runner = llm.engine.graph_runner
    largest = min(MAX_CAPTURED_PREFILL, llm.engine.runner.max_context_len)
    assert runner.extend_buckets[-1] == largest
    assert runner.takes_prefill([0], [largest]) and not runner.takes_prefill([0], [largest + 1])
    assert not runner.takes_prefill([5], [3]) and not runner.takes_prefill([0, 0], [3, 4])


def test_static_prefill_of_a_mixture_of_experts_equals_transformers(tiny_qwen3_5_moe):
    prompts = PROMPTS[:4]
    llm = LLM(tiny_qwen3_5_moe, cuda_graphs=True, max_running_requests=1, max_prefill_tokens=32)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5_moe, prompts, MAX_NEW)


@pytest.mark.parametrize("length", [1, 2, 3, 17, 32])
def test_a_padded_prefill_leaves_what_an_eager_prefill_leaves(tiny_qwen3_5, length):
    # Lengths below the conv's K-1 = 3 keep part of the (zero) initial state; 32 fills its bucket. On CUDA:
    # tests/test_gpu.py, the padded prefill captured.
    assert_a_padded_prefill_leaves_no_trace(tiny_qwen3_5, PROMPTS[4][:length], "cpu", torch.float32)
