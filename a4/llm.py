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

import difflib
import inspect
from dataclasses import fields
from pathlib import Path
from typing import Any

from a4.core import Output, Req, SamplingParams
from a4.engine.engine import Engine, EngineConfig, EngineStats, check_sampling_params
from a4.engine.memory_plan import MemoryLedger, MemoryPlan
from a4.speculative.drafter import Drafter

# What LLM(model_dir, **options) takes: every EngineConfig field but model_dir.
OPTIONS = tuple(field.name for field in fields(EngineConfig) if field.name != "model_dir")


class LLM:
    """The offline API: `LLM(model_dir, **options)`, then `generate(prompts, sampling_params)`.

    The options are the fields of `EngineConfig` (a4/engine/config.py), which documents and checks them; the
    signature above lists each with its default. An unknown option is a TypeError naming it and the valid ones.
    """

    def __init__(self, model_dir: str | Path, *, drafter: Drafter | None = None, **options: Any) -> None:
        """Load the checkpoint in model_dir and plan the engine's memory; `options`: EngineConfig's fields.

        `drafter`: who drafts for speculative decoding (`speculative_tokens=k`) instead of the checkpoint's MTP module,
        e.g. a4.speculative.drafter.OracleDrafter in tests and notebook 11."""
        for name in options:
            if name not in OPTIONS:
                close = difflib.get_close_matches(name, OPTIONS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"LLM() got an unknown option {name!r}{hint}; the options are EngineConfig's fields: "
                    + ", ".join(OPTIONS)
                )
        self.engine = Engine(EngineConfig(model_dir, **options), drafter=drafter)

    def close(self) -> None:
        """Stop the worker processes of a tensor-parallel LLM (`tensor_parallel_size` > 1; they also stop when the
        LLM is collected, when a new tensor-parallel LLM takes over the process's group, or when Python exits).
        Nothing to do for one process; safe to call twice."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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

        One Output per prompt, in order; a prompt whose SamplingParams asks for `n` > 1 samples gets n Outputs, one
        after the other (a flat list, as SGLang's offline engine returns): the samples share its one prefill
        (`Engine.add_parallel_requests`).

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
                if params.n > 1:
                    reqs += self.engine.add_parallel_requests(prompt, params)
                else:
                    reqs.append(self.engine.add_request(prompt, params))
            self.engine.run(reqs)
        except BaseException:
            for req in reqs:
                self.engine.abort_req(req, "generate() raised before this request finished")
            raise
        return [_output(req) for req in reqs]


def _init_signature() -> inspect.Signature:
    """EngineConfig's fields as LLM.__init__'s parameters (model_dir, then keyword-only options, then the drafter), so
    that help(LLM), inspect.signature and editors show every option with its default, though __init__ takes
    **options."""
    model_dir, *options = inspect.signature(EngineConfig, eval_str=True).parameters.values()
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    keyword_only = [option.replace(kind=inspect.Parameter.KEYWORD_ONLY) for option in options]
    drafter = inspect.Parameter("drafter", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Drafter | None")
    return inspect.Signature([self, model_dir, *keyword_only, drafter], return_annotation=None)


LLM.__init__.__signature__ = _init_signature()


def _output(req: Req) -> Output:
    return Output(
        token_ids=list(req.output_ids),
        cached_tokens=req.prefix_hit_len,
        finish_reason=req.finish_reason,
        error=req.error,
        logprobs=None if req.sampling_params.logprobs is None else list(req.output_logprobs),
        prompt_logprobs=None if req.sampling_params.prompt_logprobs is None else list(req.prompt_logprobs),
    )
