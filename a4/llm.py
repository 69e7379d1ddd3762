"""LLM: the offline API. Give it token-id prompts, get back their continuations.

    from a4 import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", max_prefill_tokens=256)
    outputs = llm.generate([[1, 2, 3], [1, 2, 4, 5]], SamplingParams(max_new_tokens=8))
    outputs[0].token_ids, outputs[1].cached_tokens, llm.stats.decode_tokens_per_second

All prompts are queued at once and the engine runs them with continuous batching until the last one finishes;
outputs come back in prompt order. A bad prompt gets finish_reason "error" without disturbing the others.

Memory: `memory_budget_bytes` is split between request slots (`max_running_requests` of them, fewer if they do not
fit beside the KV of one request of the model's full context) and KV pages. For a hybrid model, whose slots also
hold their Gated DeltaNet states, `state_fraction` (in (0, 1)) caps the slots' share of the budget instead, so that
KV keeps the rest (a4/engine/hybrid_memory.py).

Prefix cache of a hybrid model (`enable_prefix_cache=True`): a hit must also restore the Gated DeltaNet state after
exactly the hit's tokens. `hybrid_prefix_policy="checkpoint"` (the default) keeps up to `max_state_checkpoints` copies
of request states on the radix tree, at chunk boundaries, prompt ends and request ends, and hits only where one is
kept (a4/kvcache/hybrid_radix_cache.py); their bytes come out of `memory_budget_bytes`. "refuse" never reuses a prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from a4.core import Output, Req, SamplingParams
from a4.engine.engine import Engine, EngineConfig, EngineStats, check_sampling_params
from a4.engine.memory_plan import MemoryLedger, MemoryPlan


class LLM:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_running_requests: int = 8,
        max_prefill_tokens: int = 512,
        page_size: int = 1,
        enable_prefix_cache: bool = True,
        memory_budget_bytes: int | None = None,
        state_fraction: float | None = None,
        hybrid_prefix_policy: str = "checkpoint",
        max_state_checkpoints: int = 16,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.engine = Engine(
            EngineConfig(
                model_dir=model_dir,
                dtype=dtype,
                device=device,
                max_running_requests=max_running_requests,
                max_prefill_tokens=max_prefill_tokens,
                page_size=page_size,
                enable_prefix_cache=enable_prefix_cache,
                memory_budget_bytes=memory_budget_bytes,
                state_fraction=state_fraction,
                hybrid_prefix_policy=hybrid_prefix_policy,
                max_state_checkpoints=max_state_checkpoints,
                cuda_graphs=cuda_graphs,
            )
        )

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.engine.memory_plan

    @property
    def ledger(self) -> MemoryLedger:
        return self.engine.ledger

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Output]:
        """Continue every prompt; one SamplingParams for all, or one per prompt (default: greedy, 16 tokens).

        Every argument is checked before any prompt is queued. If an exception escapes (KeyboardInterrupt from an
        interrupted cell included), every request of this call is aborted before it propagates: the engine is as if
        the call had never been made, and the next call is served correctly.
        """
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
            raise ValueError("prompts must be a list of token-id lists, e.g. [[1, 2, 3]]")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            check_sampling_params(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        for params in sampling_params:
            check_sampling_params(params)
        reqs = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                reqs.append(self.engine.add_request(prompt, params))
            self.engine.run(reqs)
        except BaseException:
            for req in reqs:
                self.engine.abort_req(req, "generate() raised before this request finished")
            raise
        return [_output(req) for req in reqs]


def _output(req: Req) -> Output:
    return Output(
        token_ids=list(req.output_ids),
        cached_tokens=req.prefix_hit_len,
        finish_reason=req.finish_reason,
        error=req.error,
    )
