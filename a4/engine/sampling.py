"""Sampler: next tokens from the logits of one step.

Greedy (temperature 0, the default) is an argmax over float32 logits, as transformers' `generate` does, so the
engine can be checked against it token by token. Otherwise the logits are divided by the temperature, cut to the
top_k most likely tokens and to the smallest set whose probability reaches top_p, and one token is drawn. A request
with a seed draws from its own torch.Generator, so its tokens do not depend on which other requests share its batch.

The logits are shifted so that their largest is 0 before they are divided by the temperature: the distribution is
the same, and a temperature so small that the gaps overflow gives -inf to every token but the most likely ones, i.e.
the greedy limit of T -> 0 (a draw among the tokens tied for the largest logit), instead of inf - inf = NaN.

A request whose logits are not finite (a model or checkpoint gone wrong) gets an error instead of a token, and
finishes alone: the other requests of its batch are served as usual.

Sampling never waits for the device: `sample` returns the tokens as a device tensor (the next decode step reads them
there) and starts one non-blocking copy of them, with each row's finiteness, to the host; `SampledTokens.result()`
waits for that copy alone. So the engine can launch the next step before it books this one (overlap scheduling).

Before a token is picked, the rows that ask have their logits changed by vLLM's logits processors (`LogitsProcessors`:
logit_bias, min_tokens, then the presence / frequency / repetition penalties), batched over those rows only: a batch
in which no request asks pays nothing. The penalties need the tokens each request has output so far, including the
token of the step still in flight under overlap scheduling, which the host does not have yet: so their counts live
on the device, one row per penalized request, and each step adds its sampled tokens to them there (SGLang's
penalizers keep their state the same way). min_p is a cut of the sampled distribution, after the temperature.

A request that asks for log-probabilities (SamplingParams.logprobs) gets its token's and the most likely tokens', from
the same logits before any temperature or cut (logprobs.py); the others cost nothing more.

A request with a grammar (structured output, grammar.py) picks from logits whose tokens the grammar forbids are -inf:
`apply_grammar_masks`, on the device, on a copy (its logprobs stay the model's), before the processors above.

A speculative engine (speculative_worker.py) verifies a sampled request's drafts against the very distribution this
sampler draws from (`sampling_distribution`), with random numbers from the request's own generator (`generator`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from a4.core import Batch, Req, SamplingParams, TokenLogprobs, to_device
from a4.engine.grammar import RequestGrammar, apply_grammar_masks
from a4.engine.logprobs import PendingLogprobs, PromptLogprobs, PromptRows, compute_logprobs
from a4.kernels import triton_kernels_run_on


class Sample(NamedTuple):
    token: int | None
    # Why no token could be drawn for this request (then token is None), or None.
    error: str | None = None


@dataclass
class SampledTokens:
    """One step's tokens, drawn on the device and on their way to the host."""

    tokens: torch.Tensor  # [S] int64 on the device: what the next decode step feeds
    logits: torch.Tensor  # [S, vocab]: kept to say what is wrong with a row that is not finite
    _host: torch.Tensor  # [2, S]: tokens and row finiteness, filled by a non-blocking copy
    _copied: torch.cuda.Event | None  # recorded after that copy (None on the CPU: the copy is done)
    # The log-probabilities of the rows whose request asks for them (SamplingParams.logprobs): those rows, each one's
    # number of most likely tokens, and the values on their way to the host.
    logprob_rows: list[int] = field(default_factory=list)
    logprob_ks: list[int] = field(default_factory=list)
    logprobs: PendingLogprobs | None = None

    def token_logprobs(self) -> list[TokenLogprobs | None]:
        """Per row: its token's log-probabilities, None where its request did not ask."""
        per_row: list[TokenLogprobs | None] = [None] * len(self.tokens)
        if self.logprobs is not None:
            for row, entry in zip(self.logprob_rows, self.logprobs.result(self.logprob_ks)):
                per_row[row] = entry
        return per_row

    def result(self) -> list[Sample]:
        """Wait for the copy; one token (or an error) per row."""
        if self._copied is not None:
            self._copied.synchronize()
        tokens, finite = self._host.tolist()
        errors = _errors(finite, self.logits)
        return [Sample(None, error) if error is not None else Sample(token) for token, error in zip(tokens, errors)]


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        """`vocab_size` and `eos_token_ids`: what the logits processors need (a request that asks for none of them
        needs neither)."""
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self.logits_processors = LogitsProcessors(device, vocab_size, eos_token_ids)
        self._grammars: dict[int, RequestGrammar] = {}
        self._argmax_and_finite = _argmax_and_finite
        if triton_kernels_run_on(device):
            from a4.kernels.greedy import argmax_and_finite  # one read of the logits for both (a Triton kernel)

            self._argmax_and_finite = argmax_and_finite

    def add_req(self, req: Req) -> None:
        seed = req.sampling_params.seed
        if seed is not None:
            self._generators[req.uid] = torch.Generator(device=self.device).manual_seed(seed)
        self.logits_processors.add_req(req)
        if req.sampling_params.grammar is not None:
            self._grammars[req.uid] = RequestGrammar(req.sampling_params.grammar)

    def remove_req(self, req: Req) -> None:
        self._generators.pop(req.uid, None)
        self.logits_processors.remove_req(req)
        self._grammars.pop(req.uid, None)

    def generator(self, req: Req) -> torch.Generator | None:
        """The generator req draws from: its own when it has a seed, else None (torch's default one)."""
        return self._generators.get(req.uid)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampledTokens:
        """One token per row of logits [len(reqs), vocab] (float32), drawn on the device without waiting for it."""
        grammars = {}
        if self._grammars:  # a batch without any costs no lookup per row
            grammars = {i: self._grammars[req.uid] for i, req in enumerate(reqs) if req.uid in self._grammars}
        if grammars:
            finite = _rows_finite(logits)  # before the grammars' masks, whose -inf are no fault of the model's
            picked_from = logits.clone()  # the logits the tokens are picked from; logprobs are the model's own
            apply_grammar_masks(picked_from, grammars)
            tokens = picked_from.argmax(dim=-1)
        else:
            picked_from = logits
            tokens, finite = self._argmax_and_finite(logits)
        # The rows that ask are processed apart: the logits themselves stay the model's.
        rows, processed = self.logits_processors.apply(picked_from, reqs)
        if rows is not None:
            tokens[rows.device_index] = processed.argmax(dim=-1)
        for i, req in enumerate(reqs):
            if req.sampling_params.temperature > 0:
                row = processed[rows.position[i]] if rows is not None and i in rows.position else picked_from[i]
                tokens[i] = self._draw(row, req, finite[i])
        if rows is not None:
            self.logits_processors.cumulate_output_tokens(rows, tokens)
        packed = torch.stack([tokens, finite.long()])
        if self.device.type != "cuda":
            sampled = SampledTokens(tokens, logits, packed, None)
        else:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            sampled = SampledTokens(tokens, logits, host, copied)
        self._token_logprobs(sampled, reqs)
        for row, grammar in grammars.items():
            grammar.sampled(sampled, row)  # its matcher accepts the token before its next mask
        return sampled

    def prompt_logprobs(self, logits: torch.Tensor, batch: Batch, rows: list[PromptRows]) -> PromptLogprobs:
        """The prompt tokens' log-probabilities of the requests that ask, from logits [R, vocab] of `rows`."""
        return PromptLogprobs.launch(logits, batch, rows)

    def _token_logprobs(self, sampled: SampledTokens, reqs: list[Req]) -> None:
        """The sampled tokens' log-probabilities, for the rows whose request asks (none: nothing is computed)."""
        rows = [i for i, req in enumerate(reqs) if req.sampling_params.logprobs is not None]
        if rows:
            sampled.logprob_rows = rows
            sampled.logprob_ks = [reqs[i].sampling_params.logprobs for i in rows]
            index = to_device(rows, self.device)
            sampled.logprobs = compute_logprobs(sampled.logits[index], sampled.tokens[index], max(sampled.logprob_ks))

    def _draw(self, logits: torch.Tensor, req: Req, finite: torch.Tensor) -> torch.Tensor:
        probs = sampling_distribution(logits, req.sampling_params)
        # A row that is not finite gets an error, not this token; its NaN probabilities would fail the draw (on a
        # GPU, as a device-side assert that ends the process), so it draws from uniform weights instead.
        probs = torch.where(finite, probs, 1.0)
        return torch.multinomial(probs, 1, generator=self.generator(req))[0]


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request (temperature > 0) draws its next token from, for each row of logits
    [..., vocab] (float32): the temperature, then the top_k / top_p cut, then softmax."""
    # A temperature below the smallest normal float32 would round to 0 in the division (0 / 0 = NaN at the maximum);
    # at that size every gap overflows to -inf either way.
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.min_p > 0:
        # p / p_max = exp(scaled), the largest scaled logit being 0: drop what is below min_p of the most likely.
        scaled = scaled.masked_fill(scaled < math.log(params.min_p), float("-inf"))
    return torch.softmax(_filter_logits(scaled, params), dim=-1)


def logits_errors(logits: torch.Tensor) -> list[str | None]:
    """Per row of logits [N, ...]: why it cannot be sampled (it is not finite), or None."""
    return _errors(_rows_finite(logits.flatten(1)).tolist(), logits)


def _argmax_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [N, vocab]: its argmax and whether it is finite (a4/kernels/greedy.py does both in one read
    where a4's Triton kernels run)."""
    return logits.argmax(dim=-1), _rows_finite(logits)


def _rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, vocab]: whether every element is finite. A row's minimum and maximum are finite exactly
    when all of it is (min and max propagate NaN), and one reduction costs less than `isfinite(logits).all()`, which
    writes a mask first: on an H200 at batch 128 (127 MB of float32 logits) five launches and ~0.19 ms a step. (A sum
    would overflow on finite rows near the float32 maximum.)"""
    low, high = torch.aminmax(logits, dim=-1)
    return low.isfinite() & high.isfinite()


def _errors(finite: list, logits: torch.Tensor) -> list[str | None]:
    """finite: per row, whether it is finite (bools, or 0 / 1). Only a row that is not is indexed: iterating over
    logits would make a view of every row, ~0.4 µs each on the host."""
    return [None if ok else _non_finite_error(logits[i]) for i, ok in enumerate(finite)]


def _non_finite_error(logits: torch.Tensor) -> str:
    nan, inf = int(logits.isnan().sum()), int(logits.isinf().sum())
    return (
        f"the model's logits are not finite ({nan} NaN, {inf} infinite of {logits.numel()}): "
        "check the checkpoint's weights and the layers' numerics"
    )


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] with every token outside each row's top_k / top_p set at -inf."""
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token is always kept.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class ProcessedRows:
    """The rows of a step's batch whose logits are processed: their positions in the batch (on the host, and
    on the device) and their rows of the penalty state (-1: not penalized)."""

    position: dict[int, int]  # batch row -> row of the processed logits
    device_index: torch.Tensor  # [P] the batch rows, in order
    reqs: list[Req]


class LogitsProcessors:
    """vLLM's logits processors of a request (logit_bias, min_tokens, presence / frequency / repetition penalties),
    applied on the device to the rows of a batch that ask, together.

    A penalized request has a row of the penalty state for as long as it runs: its output token counts (updated on
    the device from the tokens sampled, `cumulate_output_tokens`), the set of its prompt's tokens and its three
    penalties. The rows are allocated as requests come and the state grows when they run out, so that memory is
    spent only on the requests that ask (a row is 5 bytes per vocabulary entry)."""

    def __init__(self, device: torch.device, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._free_rows: list[int] = []
        self._rows: dict[int, int] = {}  # request uid -> row of the penalty state
        self._output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._penalties = torch.zeros(0, 3, dtype=torch.float32, device=device)  # presence, frequency, repetition
        # Per request that asks: the ids and values added to its logits, and the ids masked until min_tokens.
        self._bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._min_tokens_ids: dict[int, torch.Tensor] = {}

    def add_req(self, req: Req) -> None:
        params = req.sampling_params
        if params.logit_bias:
            ids, values = zip(*params.logit_bias.items())
            self._bias[req.uid] = (to_device(list(ids), self.device),
                                   torch.tensor(values, dtype=torch.float32).to(self.device))  # fmt: skip
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            self._min_tokens_ids[req.uid] = to_device(sorted({*eos, *params.stop_token_ids}), self.device)
        if params.penalized:
            row = self._allocate_row()
            self._rows[req.uid] = row
            self._output_counts[row] = 0
            self._prompt_mask[row] = False
            if params.repetition_penalty != 1:
                self._prompt_mask[row, to_device(req.input_ids, self.device)] = True
            penalties = [params.presence_penalty, params.frequency_penalty, params.repetition_penalty]
            self._penalties[row] = torch.tensor(penalties, dtype=torch.float32)

    def remove_req(self, req: Req) -> None:
        self._bias.pop(req.uid, None)
        self._min_tokens_ids.pop(req.uid, None)
        row = self._rows.pop(req.uid, None)
        if row is not None:
            self._free_rows.append(row)

    def apply(self, logits: torch.Tensor, reqs: list[Req]) -> tuple[ProcessedRows | None, torch.Tensor | None]:
        """The rows of `logits` [len(reqs), vocab] that ask and their processed logits [P, vocab]; (None, None) when
        none asks. Each request is sampling its `num_sampled`-th output token (this step's is counted already)."""
        asking = [i for i, req in enumerate(reqs) if req.sampling_params.processes_logits]
        if not asking:
            return None, None
        asking_reqs = [reqs[i] for i in asking]
        state_rows = [self._rows.get(req.uid, -1) for req in asking_reqs]
        packed = to_device(asking + state_rows, self.device)
        rows = ProcessedRows({i: p for p, i in enumerate(asking)}, packed[: len(asking)], asking_reqs)
        processed = logits[rows.device_index]
        self._add_bias(processed, asking_reqs)
        self._mask_until_min_tokens(processed, asking_reqs)
        if any(row >= 0 for row in state_rows):
            penalized = [p for p, row in enumerate(state_rows) if row >= 0]
            index = to_device(penalized + [row for row in state_rows if row >= 0], self.device)
            positions, state = index.split(len(penalized))
            processed[positions] = self._penalize(processed[positions], state)
        return rows, processed

    def cumulate_output_tokens(self, rows: ProcessedRows, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (tokens [S] on the device, for the whole batch) in the penalized requests'
        rows, on the device: the next step's penalties see them before the host does."""
        penalized = [(p, self._rows[req.uid]) for p, req in enumerate(rows.reqs) if req.uid in self._rows]
        if not penalized:
            return
        positions, state_rows = to_device([p for p, _ in penalized] + [r for _, r in penalized], self.device).split(
            len(penalized))
        sampled = tokens[rows.device_index[positions]]
        self._output_counts.index_put_((state_rows, sampled), torch.ones_like(sampled, dtype=torch.int32),
                                       accumulate=True)  # fmt: skip

    def _add_bias(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        biased = [(p, self._bias[req.uid]) for p, req in enumerate(reqs) if req.uid in self._bias]
        if biased:
            rows = torch.cat([torch.full_like(ids, p) for p, (ids, _) in biased])
            ids = torch.cat([ids for _, (ids, _) in biased])
            logits.index_put_((rows, ids), torch.cat([values for _, (_, values) in biased]), accumulate=True)

    def _mask_until_min_tokens(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        # num_sampled counts this step's token: the request has num_sampled - 1 output tokens before it.
        masked = [(p, self._min_tokens_ids[req.uid]) for p, req in enumerate(reqs)
                  if req.uid in self._min_tokens_ids and req.num_sampled - 1 < req.sampling_params.min_tokens]  # fmt: skip
        if masked:
            rows = torch.cat([torch.full_like(ids, p) for p, ids in masked])
            logits[rows, torch.cat([ids for _, ids in masked])] = float("-inf")

    def _penalize(self, logits: torch.Tensor, state_rows: torch.Tensor) -> torch.Tensor:
        """vLLM's `apply_penalties` on logits [P, vocab] of the penalized requests in state_rows [P]."""
        counts = self._output_counts[state_rows]
        output_mask = counts > 0
        presence, frequency, repetition = self._penalties[state_rows].unbind(dim=-1)
        seen = output_mask | self._prompt_mask[state_rows]
        factor = torch.where(seen, repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
        return logits - frequency[:, None] * counts - presence[:, None] * output_mask

    def _allocate_row(self) -> int:
        if not self._free_rows:
            old = self._output_counts.shape[0]
            grown = max(2 * old, 4)
            self._output_counts = _grown(self._output_counts, grown)
            self._prompt_mask = _grown(self._prompt_mask, grown)
            self._penalties = _grown(self._penalties, grown)
            self._free_rows = list(range(grown - 1, old - 1, -1))
        return self._free_rows.pop()


def _grown(state: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([state, state.new_zeros(rows - state.shape[0], *state.shape[1:])])
