"""What the engine checks of a request before it queues it: its SamplingParams' type, what of them depends on the
engine (token ids in the vocabulary, n within the running requests), and its prompt.

A caller's mistake (SamplingParams of another type) is an exception; a request that cannot run (an empty prompt, a
token outside the vocabulary, a prompt too long for the context) finishes at once with finish_reason "error" and
this module's message, and the engine goes on serving the others.
"""

from __future__ import annotations

import operator

from a4.core import SamplingParams
from a4.models.config import ModelConfig


def check_sampling_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"expected a4.SamplingParams, got {type(params).__name__} {params!r}: "
            "write SamplingParams(max_new_tokens=..., ...)"
        )


def prompt_error(input_ids: list[int], model_config: ModelConfig, max_context_len: int, kv_tokens: int) -> str | None:
    """Why this prompt cannot run, or None. (SamplingParams check themselves on construction.)"""
    if len(input_ids) == 0:
        return "empty prompt: at least one token is needed"
    vocab_size = model_config.vocab_size
    for position, token in enumerate(input_ids):
        try:
            # bool is an int in Python (True == 1): a prompt of bools is a mistake, not token 1.
            token = operator.index(token) if not isinstance(token, bool) else None
        except TypeError:
            token = None
        if token is None:
            return f"token {input_ids[position]!r} at position {position} is not an integer token id"
        if not 0 <= token < vocab_size:
            return f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
    if len(input_ids) >= max_context_len:
        return (
            f"prompt of {len(input_ids)} tokens is too long: the context holds {max_context_len} tokens "
            f"(max_position_embeddings {model_config.max_position_embeddings}, KV pool {kv_tokens} tokens, less "
            "the positions of a step's drafts) and at least one must be left to generate"
        )
    return None


def sampling_error(params: SamplingParams, model_config: ModelConfig, max_running_requests: int) -> str | None:
    """Why these SamplingParams cannot run on this engine, or None (their own values checked themselves)."""
    vocab_size = model_config.vocab_size
    for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
        outside = [token for token in tokens if token >= vocab_size]
        if outside:
            return f"{name}: token ids {outside} are outside the vocabulary [0, {vocab_size})"
    if params.n > max_running_requests:
        return f"n: {params.n} samples run together, more than the engine runs at once ({max_running_requests})"
    return None
