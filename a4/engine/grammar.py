"""Structured output: JSON that a request's tokens must spell, through xgrammar (vLLM's and SGLang's default grammar
library; a grammar engine is not something to write by hand).

Two halves, as in vLLM's `StructuredOutputManager` and SGLang's `XGrammarGrammarBackend`:

- `GrammarBackend` compiles a JSON schema into xgrammar's `CompiledGrammar` for one tokenizer (its vocabulary decoded
  once, from the checkpoint's own tokenizer files). xgrammar's compiler caches what it compiles by schema text, so a
  schema is compiled once; the server calls it in a worker thread, and a schema xgrammar cannot compile is a
  ValueError (a 400 there) before the request reaches the engine. The request carries the compiled grammar in
  `SamplingParams.grammar`.
- `RequestGrammar` is one request's `GrammarMatcher`; `apply_grammar_masks` fills the token bitmask of each row of a
  step that has a grammar and sets every token the grammar forbids to -inf on the device, before the sampler picks
  (greedy or drawn, it can then only pick an allowed token).

A matcher must have accepted every token its request sampled before it can say what may come next. The sampler
(sampling.py) hands each row's step to its RequestGrammar, which accepts the token at the request's next step,
waiting for that step's copy to the host only then. Under overlap scheduling that is the step still in flight: as in
SGLang's overlap scheduler, the next step's forward is already launched, and only its sampling waits for the
previous step's tokens (the grammar requests' rows can only be masked once those are known). What it costs: the
host's wait for the previous step and the mask fill sit between the two steps' device work, where overlap would have
hidden the host's scheduling; steps without a grammar request pay nothing.

The grammar's stop tokens are the model's end-of-sequence tokens: once the JSON is complete only those are allowed,
and the request finishes at one like any other ("stop" in the API). So a grammar cannot be combined with
`ignore_eos`, and a speculative engine refuses grammars (its verify step would need a mask per draft position).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from a4.core import SamplingParams
from a4.models.config import ModelConfig

# As vLLM's default VLLM_XGRAMMAR_CACHE_MB: compiled grammars kept for schemas seen again, bounded (clients choose
# the schemas).
GRAMMAR_CACHE_BYTES = 512 * 2**20


class GrammarBackend:
    """Compiles JSON grammars for one model's tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`tokenizer`: the model's transformers tokenizer (loaded from the checkpoint's files, nothing downloaded);
        `vocab_size`: the model's, which may be padded beyond the tokenizer's (the mask covers every logit)."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def json_schema(self, schema: dict[str, Any]) -> xgr.CompiledGrammar:
        """The grammar of JSON valid against `schema`, followed strictly (no properties or items beyond those it
        names), as vLLM does whatever the request's `strict`. A schema xgrammar refuses is a ValueError saying why.

        The JSON is compact (no free whitespace; xgrammar's separators ", " and ": "): with whitespace allowed
        between tokens a small model can emit spaces and newlines until max_tokens, as the trained tiny Qwen3.5 does
        (vLLM's `disable_any_whitespace` option, made the default here)."""
        return self._compile(schema, strict=True)

    def json_object(self) -> xgr.CompiledGrammar:
        """The grammar of any JSON object (OpenAI's `json_object`), compact as `json_schema`'s."""
        return self._compile({"type": "object"}, strict=False)

    def _compile(self, schema: dict[str, Any], strict: bool) -> xgr.CompiledGrammar:
        try:
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
        except RuntimeError as e:  # xgrammar's C++ errors, prefixed with the time and the source line that raised
            raise ValueError(re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()) from None


def grammar_error(params: SamplingParams, model_config: ModelConfig) -> str | None:
    """Why this request's grammar cannot be followed by this engine, or None (no grammar, or one it can follow).
    A grammar that is not xgrammar's CompiledGrammar is a TypeError: a caller's mistake."""
    grammar = params.grammar
    if grammar is None:
        return None
    if not isinstance(grammar, xgr.CompiledGrammar):
        raise TypeError(f"SamplingParams.grammar must be an xgrammar CompiledGrammar (GrammarBackend.json_schema), "
                        f"got {type(grammar).__name__}")  # fmt: skip
    if grammar.tokenizer_info.vocab_size != model_config.vocab_size:
        return (f"the grammar was compiled for a vocabulary of {grammar.tokenizer_info.vocab_size} tokens, the model "
                f"has {model_config.vocab_size}: compile it with this model's tokenizer")  # fmt: skip
    if params.ignore_eos:
        return "a grammar ends the output with an end-of-sequence token: it cannot be combined with ignore_eos"
    return None


class RequestGrammar:
    """One request's GrammarMatcher, and the tokens it sampled that the matcher has not accepted yet."""

    def __init__(self, grammar: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(grammar)
        # (step's tokens, this request's row): sampled, perhaps still on their way to the host.
        self._unaccepted: list[tuple[Any, int]] = []

    def sampled(self, tokens, row: int) -> None:
        """`tokens` (sampling.SampledTokens) holds this request's next token at `row`; the matcher accepts it before
        the next mask."""
        self._unaccepted.append((tokens, row))

    def catch_up(self, host_tokens: dict[int, list]) -> None:
        """Accept the tokens sampled since the last mask. host_tokens: each step's tokens on the host, by id of its
        SampledTokens, shared by the requests of a step so that each step is waited for and copied once."""
        for tokens, row in self._unaccepted:
            if id(tokens) not in host_tokens:
                host_tokens[id(tokens)] = tokens.result()
            # A row whose logits were not finite gets an error and finishes when booked: its token is not kept, and
            # the matcher stays where it was.
            if (token := host_tokens[id(tokens)][row].token) is not None:
                self.matcher.accept_token(token)
        self._unaccepted.clear()


def apply_grammar_masks(logits: torch.Tensor, grammars: dict[int, RequestGrammar]) -> None:
    """Set the logits of every token its grammar forbids to -inf, in place, in the rows of logits [S, vocab] that
    `grammars` names (row -> its request's grammar).

    A matcher that has terminated (it accepted an end-of-sequence token) belongs to a request that has finished: it
    is still in this step only because overlap scheduling launched the step before booking the one that finished it,
    and its token here is dropped. Its row is left as it is."""
    host_tokens: dict[int, list] = {}
    for grammar in grammars.values():
        grammar.catch_up(host_tokens)
    rows = [row for row, grammar in grammars.items() if not grammar.matcher.is_terminated()]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row in rows:
        grammars[row].matcher.fill_next_token_bitmask(bitmask, row)
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
