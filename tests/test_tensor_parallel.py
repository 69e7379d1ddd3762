"""The engine split over N processes (`LLM(..., tensor_parallel_size=N)`, a4/distributed), on the CPU over gloo:
its tokens against transformers' greedy generation (a4.reference.hf_greedy), float32, token by token.

Each rank's share of every layer sums to the unsplit layer only to rounding (a row-parallel layer adds its partial
sums in another order), so the tokens are transformers' as long as no top-1 / top-2 logit gap is as small as that
rounding, as for every other engine test on these checkpoints (their gaps: a4.checkpoints). Two ranks for every
model and policy; four where the tiny shapes divide (Qwen3, and Qwen3.5 and Qwen3.5-MoE with four key heads). One LLM serves several
checks, to keep the spawned processes few. What each layer's share computes is tests/test_tensor_parallel_layers.py.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import replace

import pytest
import torch.distributed as dist

from a4 import LLM, SamplingParams
from a4.checkpoints import tiny_checkpoint
from a4.core import ForwardMode
from a4.course.checks._harness import random_tokens
from a4.engine.hybrid_memory import hybrid_ledger
from a4.distributed.sharding import rank_model_config
from a4.kvcache.state_pool import StatePool
from a4.models.config import load_model_config
from a4.reference import hf_greedy

NEW_TOKENS = 8
# Below the presets' special tokens, at the end of the vocabulary: prompts without an end-of-sequence token.
PROMPT_VOCAB = 1000
# Small enough that the longer prompts are prefilled in chunks, and that two slots serve four prompts (slot reuse).
ENGINE = dict(max_prefill_tokens=16, max_running_requests=2)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    return [random_tokens(n, seed=seed + i, vocab=PROMPT_VOCAB) for i, n in enumerate(lengths)]


VARLEN = prompts(3, 17, 40, 9)


def assert_matches_transformers(llm: LLM, checkpoint, batch: list[list[int]], new_tokens: int = NEW_TOKENS):
    outputs = llm.generate(batch, SamplingParams(max_new_tokens=new_tokens))
    expected = hf_greedy(checkpoint, batch, new_tokens)
    for i, (output, tokens) in enumerate(zip(outputs, expected)):
        assert output.token_ids == tokens, f"prompt {i} ({len(batch[i])} tokens): {output.token_ids} != {tokens}"
    return outputs


@pytest.fixture(scope="module")
def qwen3_5():
    return tiny_checkpoint("qwen3_5")


def worker_checkpoint_keys(llm: LLM) -> list[list[int]]:
    return [report.checkpoint_keys for report in llm.engine.tp.reports()]


def rank0_checkpoint_keys(llm: LLM) -> list[int]:
    return sorted(checkpoint.key for _, checkpoint in llm.engine.cache_manager.prefix_cache.checkpoints())


# --- errors before any process starts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, overrides, size, field",
    [
        ("qwen3", {}, 3, "num_attention_heads"),
        ("qwen3_5", {}, 4, "linear_num_key_heads"),
        ("qwen3", {}, 3, "vocab_size"),
        # Every other field of the tiny MoE checkpoint divides by two.
        ("qwen3_5_moe", {"num_experts": 5}, 2, "num_experts"),
    ],
)
def test_a_split_that_does_not_divide_names_the_field(arch, overrides, size, field):
    with pytest.raises(ValueError, match=f"{field} = "):
        LLM(tiny_checkpoint(arch, **overrides), tensor_parallel_size=size)


def test_tensor_parallel_size_must_be_a_positive_integer(qwen3_5):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(qwen3_5, tensor_parallel_size=0)


# --- tokens = transformers' -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 4])
def test_qwen3(size):
    # Four ranks and two KV heads: each KV head replicated on the two ranks whose query heads read it.
    checkpoint = tiny_checkpoint("qwen3")
    with LLM(checkpoint, tensor_parallel_size=size, **ENGINE) as llm:
        assert_matches_transformers(llm, checkpoint, VARLEN)


@pytest.fixture(scope="class")
def llm_qwen3_5(qwen3_5):
    """Closed after the class that uses it."""
    # cuda_graphs=True on the CPU: decode steps through the static-buffer runner, the GPU's path, run eagerly.
    with LLM(qwen3_5, tensor_parallel_size=2, cuda_graphs=True, **ENGINE) as llm:
        yield llm


class TestQwen3_5TwoRanks:
    """One two-rank engine for these checks (a process runs one tensor-parallel engine at a time): tokens, prefix
    hits, the per-rank memory plan, an interrupt."""

    def test_qwen3_5_single(self, llm_qwen3_5, qwen3_5):
        assert_matches_transformers(llm_qwen3_5, qwen3_5, prompts(21, seed=10))

    def test_qwen3_5_varlen_chunked_slot_reuse(self, llm_qwen3_5, qwen3_5):
        assert_matches_transformers(llm_qwen3_5, qwen3_5, VARLEN)

    def test_qwen3_5_prefix_hits_restore_every_rank(self, llm_qwen3_5, qwen3_5):
        first = prompts(20, seed=20)[0]
        (done,) = assert_matches_transformers(llm_qwen3_5, qwen3_5, [first])
        # The next turn of a chat, and a prompt that shares only the first chunk boundary (16 tokens).
        turn = first + done.token_ids + prompts(5, seed=21)[0]
        sibling = first[:16] + prompts(7, seed=22)[0]
        outputs = assert_matches_transformers(llm_qwen3_5, qwen3_5, [turn, sibling])
        assert [output.cached_tokens for output in outputs] == [len(first) + NEW_TOKENS - 1, 16]
        # Every checkpoint saved on rank 0 is saved on the worker, and every one dropped is dropped there.
        assert worker_checkpoint_keys(llm_qwen3_5) == [rank0_checkpoint_keys(llm_qwen3_5)]

    def test_each_rank_plans_and_pools_its_share(self, llm_qwen3_5, qwen3_5):
        whole, dtype = load_model_config(qwen3_5), llm_qwen3_5.engine.config.torch_dtype
        ledger = llm_qwen3_5.ledger
        # Rank 0's ledger is one rank's: half the state (its heads' channels and value heads), half the KV heads.
        assert ledger == hybrid_ledger(rank_model_config(whole, 2), dtype)
        assert 2 * ledger.state_bytes_per_slot == StatePool.bytes_per_slot(whole, dtype)
        assert 2 * ledger.kv_bytes_per_token == hybrid_ledger(whole, dtype).kv_bytes_per_token
        # The worker's pools hold what its ledger says, as rank 0's do.
        (report,) = llm_qwen3_5.engine.tp.reports()
        assert report.state_bytes_per_slot == ledger.state_bytes_per_slot
        assert report.kv_bytes_per_token == llm_qwen3_5.engine.kv_pool.bytes_per_token == ledger.kv_bytes_per_token

    def test_ctrl_c_inside_a_forward_leaves_every_rank_as_before(self, llm_qwen3_5, qwen3_5):
        llm, engine = llm_qwen3_5, llm_qwen3_5.engine
        # Ctrl-C raises KeyboardInterrupt, also where the test runner was started with SIGINT ignored.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        free_slots, free_pages = engine.table_manager.available_size, engine.cache_manager.available_pages
        keys_before = rank0_checkpoint_keys(llm)

        def ctrl_c(module, args, output):
            # In the middle of the model: rank 0 holds the interrupt until every rank has finished the forward.
            if args[-1].mode is ForwardMode.DECODE:
                os.kill(os.getpid(), signal.SIGINT)

        handle = engine.model.model.layers[3].register_forward_hook(ctrl_c)
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts(12, 30, seed=40), SamplingParams(max_new_tokens=NEW_TOKENS))
        finally:
            handle.remove()
            signal.signal(signal.SIGINT, previous)
        assert engine.table_manager.available_size == free_slots
        assert engine.cache_manager.available_pages == free_pages
        # The prefill before the interrupt saved checkpoints, on every rank alike.
        assert worker_checkpoint_keys(llm) == [rank0_checkpoint_keys(llm)] and keys_before
        assert_matches_transformers(llm, qwen3_5, prompts(12, 30, seed=40))


def test_qwen3_5_refuse_policy_with_merged_projections(qwen3_5):
    # merge_projections: each rank's shares of in_proj_qkv / z / b / a (and q / k / v, gate / up) as one GEMM.
    first = prompts(20, seed=30)[0]
    options = dict(hybrid_prefix_policy="refuse", merge_projections=True, **ENGINE)
    with LLM(qwen3_5, tensor_parallel_size=2, **options) as llm:
        outputs = assert_matches_transformers(llm, qwen3_5, [first, first + prompts(4, seed=31)[0]])
        assert [output.cached_tokens for output in outputs] == [0, 0]


def test_qwen3_5_speculative_decoding(qwen3_5):
    # The MTP module split like the model; the verify states of every rank committed at the accepted length.
    with LLM(qwen3_5, tensor_parallel_size=2, speculative_tokens=2, **ENGINE) as llm:
        assert_matches_transformers(llm, qwen3_5, VARLEN[:3])
        assert llm.stats.draft_tokens > 0


def test_qwen3_5_n_samples_fork_on_every_rank(qwen3_5):
    """n > 1: the samples share the prompt's whole pages and copy its partial last page (a prompt of 17 tokens in
    pages of 4) and its GDN state, on every rank alike."""
    prompt = VARLEN[1]
    with LLM(qwen3_5, tensor_parallel_size=2, page_size=4, max_prefill_tokens=16, max_running_requests=3) as llm:
        greedy = llm.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, n=3))
        assert [out.token_ids for out in greedy] == hf_greedy(qwen3_5, [prompt], NEW_TOKENS) * 3
        sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7, n=3)
        forks = [out.token_ids for out in llm.generate([prompt], sampled)]
        singles = [out.token_ids for out in llm.generate([prompt] * 3, [replace(sampled, seed=7 + j, n=1)
                                                                        for j in range(3)])]  # fmt: skip
        assert forks == singles and len({tuple(tokens) for tokens in forks}) > 1


def test_qwen3_5_four_ranks():
    # One key head and one value head per rank; two KV heads over four ranks, replicated.
    checkpoint = tiny_checkpoint("qwen3_5", linear_num_key_heads=4)
    with LLM(checkpoint, tensor_parallel_size=4, **ENGINE) as llm:
        assert_matches_transformers(llm, checkpoint, VARLEN[:2])


@pytest.mark.parametrize("size, overrides", [(2, {}), (4, {"linear_num_key_heads": 4})])
def test_qwen3_5_moe(size, overrides):
    # Expert parallelism: each rank runs the token-expert pairs routed to its 8 / size experts.
    checkpoint = tiny_checkpoint("qwen3_5_moe", **overrides)
    with LLM(checkpoint, tensor_parallel_size=size, **ENGINE) as llm:
        assert_matches_transformers(llm, checkpoint, VARLEN if size == 2 else VARLEN[:2])


def test_qwen3_5_moe_speculative_decoding(tiny_qwen3_5_moe):
    # The MTP module's MoE layer (its experts merged at load) split like the model's: experts across the ranks.
    with LLM(tiny_qwen3_5_moe, tensor_parallel_size=2, speculative_tokens=2, **ENGINE) as llm:
        assert_matches_transformers(llm, tiny_qwen3_5_moe, VARLEN[:3])
        assert llm.stats.draft_tokens > 0


# --- a worker that dies ---------------------------------------------------------------------------------------


def test_a_killed_worker_is_a_clear_error():
    checkpoint = tiny_checkpoint("qwen3")
    with LLM(checkpoint, tensor_parallel_size=2, **ENGINE) as llm:
        (worker,) = llm.engine.tp.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(RuntimeError, match="worker rank 1 .* was killed by SIGKILL"):
            llm.generate(prompts(5), SamplingParams(max_new_tokens=2))
        with pytest.raises(RuntimeError, match="engine is down"):
            llm.generate(prompts(5), SamplingParams(max_new_tokens=2))


def test_a_worker_killed_during_a_step_is_a_clear_error():
    checkpoint = tiny_checkpoint("qwen3")
    with LLM(checkpoint, tensor_parallel_size=2, **ENGINE) as llm:
        (worker,) = llm.engine.tp.workers

        def kill(module, args):
            # Between two all-reduces: rank 0's next one finds the connection closed.
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()

        llm.engine.model.model.layers[1].register_forward_pre_hook(kill)
        with pytest.raises(RuntimeError, match="worker rank 1 .* was killed by SIGKILL"):
            llm.generate(prompts(5), SamplingParams(max_new_tokens=2))
        assert not worker.is_alive()


# --- a cell run again -------------------------------------------------------------------------------------------


def test_a_new_engine_takes_over_from_the_one_before():
    """A notebook cell `llm = LLM(..., tensor_parallel_size=2)` run twice: the second engine serves, the first is shut
    down (its worker gone, its calls refused, saying why)."""
    checkpoint = tiny_checkpoint("qwen3")
    first = LLM(checkpoint, tensor_parallel_size=2, **ENGINE)
    (first_worker,) = first.engine.tp.workers
    with LLM(checkpoint, tensor_parallel_size=2, **ENGINE) as second:
        assert first_worker.exitcode is not None
        with pytest.raises(RuntimeError, match="engine is down .*a newer tensor-parallel LLM took over"):
            first.generate(prompts(5), SamplingParams(max_new_tokens=2))
        first.close()  # leaves the second's group alone
        assert_matches_transformers(second, checkpoint, prompts(5, 9))


def test_an_unreachable_engine_releases_its_worker_and_group():
    """Dropped without close(): its worker and group are released when it is collected, and an engine that sits in a
    reference cycle the garbage collector has not freed yet is taken over by the next one."""
    checkpoint = tiny_checkpoint("qwen3")

    def dropped(in_a_cycle: bool) -> list:
        llm = LLM(checkpoint, tensor_parallel_size=2, **ENGINE)
        llm.generate(prompts(5), SamplingParams(max_new_tokens=2))
        if in_a_cycle:
            llm.itself = llm
        return llm.engine.tp.workers

    (collected,) = dropped(in_a_cycle=False)
    assert collected.exitcode is not None and not dist.is_initialized()
    gc.disable()
    try:
        (uncollected,) = dropped(in_a_cycle=True)
        assert uncollected.is_alive() and dist.is_initialized()
        with LLM(checkpoint, tensor_parallel_size=2, **ENGINE) as llm:
            assert uncollected.exitcode is not None
            gc.collect()  # the old engine's release leaves the new group alone
            assert_matches_transformers(llm, checkpoint, prompts(5))
    finally:
        gc.enable()
