"""Checks of notebook 07: the prefix cache of a hybrid model, against transformers and an independent record.

Two ground truths:
- the tokens: transformers' greedy generation of each prompt alone (`a4.reference.hf_greedy`), whatever the engine
  reused to produce them;
- where a hit may land: `CheckpointRecord`, a model of the checkpoint policy written here from the requests alone
  (which tokens were fed, where chunks were cut), not from a4's tree. It lists the token sequences whose state the
  policy stores (every chunk boundary, prompt end and request end, page-aligned, least recently used evicted
  first) and predicts each hit: the longest stored sequence that is a prefix of the prompt minus its last token.
  Every check compares each request's `cached_tokens` with that prediction exactly: a hit where no state was
  stored, or a miss where one was, fails.

The workloads are multi-turn chats (`chat_workload`, played round by round by `play_chat`: each turn's prompt is the
whole conversation so far plus a new user message) and requests served one at a time with chunked prefill
(`branching_requests`), so that every checkpoint position follows from the workload alone.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from a4.core import SamplingParams
from a4.course.checks import CheckFailed, conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks.common import read_config, stop_tokens, text_config

if TYPE_CHECKING:
    from a4 import LLM

# New tokens per request; a multi-turn chat's assistant reply.
MAX_NEW_TOKENS = 6
# Enough that no check evicts a checkpoint, except the eviction check.
NO_EVICTION = 64
# The prefill budget of the one-by-one workloads: prompts are cut into chunks of this many tokens.
CHUNK = 24


# ---------------------------------------------------------------------------------------------------------- workloads


def allowed_tokens(checkpoint: str | Path) -> list[int]:
    """Token ids prompts are drawn from: the vocabulary without end-of-sequence ids."""
    vocab = text_config(read_config(checkpoint))["vocab_size"]
    return sorted(set(range(vocab)) - stop_tokens(checkpoint))


def random_prompt(rng: random.Random, allowed: Sequence[int], n: int) -> list[int]:
    return [rng.choice(allowed) for _ in range(n)]


@dataclass(frozen=True)
class ChatWorkload:
    """Conversations that share a system prompt. messages[c][t] is conversation c's user message in its turn t; the
    conversation starts in round starts[c], so that turns of different conversations interleave."""

    system: list[int]
    messages: list[list[list[int]]]
    starts: list[int]
    max_new_tokens: int

    @property
    def num_rounds(self) -> int:
        return max(start + len(turns) for start, turns in zip(self.starts, self.messages))


def chat_workload(
    checkpoint: str | Path,
    *,
    conversations: int = 4,
    turns: int = 4,
    system_len: int = 32,
    message_lens: tuple[int, int] = (6, 20),
    max_new_tokens: int = MAX_NEW_TOKENS,
    staggered: bool = True,
    seed: int = 0,
) -> ChatWorkload:
    """Random conversations: a shared system prompt, user messages of message_lens tokens, one new conversation
    per round when staggered (all in round 0 otherwise)."""
    rng = random.Random(seed)
    allowed = allowed_tokens(checkpoint)
    messages = [
        [random_prompt(rng, allowed, rng.randint(*message_lens)) for _ in range(turns)] for _ in range(conversations)
    ]
    starts = list(range(conversations)) if staggered else [0] * conversations
    return ChatWorkload(random_prompt(rng, allowed, system_len), messages, starts, max_new_tokens)


@dataclass(frozen=True)
class Turn:
    """One request of a chat: its prompt (the conversation so far + a user message), a4's output and its hit."""

    conversation: int
    turn: int
    round: int
    prompt: list[int]
    output: list[int]
    cached_tokens: int


def play_chat(llm: LLM, workload: ChatWorkload) -> list[Turn]:
    """Serve the chats round by round, like a chat client: one generate call per round with every active
    conversation's next prompt, which is the whole conversation so far (with a4's replies) plus the user message."""
    histories = [list(workload.system) for _ in workload.messages]
    params = SamplingParams(max_new_tokens=workload.max_new_tokens)
    played = []
    for round_ in range(workload.num_rounds):
        active = [
            (c, round_ - start)
            for c, start in enumerate(workload.starts)
            if 0 <= round_ - start < len(workload.messages[c])
        ]
        prompts = [histories[c] + workload.messages[c][t] for c, t in active]
        for (c, t), prompt, out in zip(active, prompts, llm.generate(prompts, params)):
            if out.error is not None:
                raise CheckFailed(f"conversation {c}, turn {t}: the request failed: {out.error}")
            histories[c] = prompt + out.token_ids
            played.append(Turn(c, t, round_, prompt, out.token_ids, out.cached_tokens))
    return played


# ------------------------------------------------------------------------------------------- the independent record


class CheckpointRecord:
    """Where the checkpoint policy stores states, derived from the requests alone: the hits it allows.

    A request with prompt P (L tokens) that hit h tokens, fed in chunks of `prefill_budget` tokens (None: whole), with
    output O, leaves its state after P[:h + budget], P[:h + 2 budget], ... (chunk boundaries), after P (its prompt)
    and after P + O[:-1] (everything fed: the last output token is never fed back). With page_size > 1 only
    page-aligned lengths can be stored, and the prefill pauses at the prompt's last page boundary, where chunking
    starts again. At most max_checkpoints are kept (None: no limit), least recently used evicted first; a hit and a
    store count as uses.
    """

    def __init__(self, page_size: int = 1, prefill_budget: int | None = None, max_checkpoints: int | None = None):
        self.page_size = page_size
        self.prefill_budget = prefill_budget
        self.max_checkpoints = max_checkpoints
        # Stored token sequences, least recently used first.
        self.stored: list[tuple[int, ...]] = []

    def hit(self, prompt: Sequence[int]) -> int:
        """The longest stored sequence that is a prefix of prompt minus its last token (0: none); it becomes the
        most recently used."""
        matchable = tuple(prompt[:-1])
        best = max((seq for seq in self.stored if matchable[: len(seq)] == seq), key=len, default=())
        if best:
            self._use(best)
        return len(best)

    def store(self, prompt: Sequence[int], output: Sequence[int], hit: int) -> None:
        """Record the checkpoints a request leaves, in the order the engine saves them."""
        fed = list(prompt) + list(output[:-1])
        pause = len(prompt) - len(prompt) % self.page_size
        if hit < pause < len(prompt):
            lengths = self._chunk_ends(hit, pause) + self._chunk_ends(pause, len(prompt))
        else:
            lengths = self._chunk_ends(hit, len(prompt))
        for n in lengths + [len(fed)]:
            if n > 0 and n % self.page_size == 0:
                self._use(tuple(fed[:n]))

    def serve(self, prompt: Sequence[int], output: Sequence[int]) -> int:
        """A request served alone: its hit, then its checkpoints."""
        hit = self.hit(prompt)
        self.store(prompt, output, hit)
        return hit

    def _chunk_ends(self, start: int, end: int) -> list[int]:
        """Where the prefill of positions start..end-1 stops: every prefill_budget tokens, and at end."""
        step = self.prefill_budget or end - start
        return [*range(start + step, end, step), end]

    def _use(self, seq: tuple[int, ...]) -> None:
        if seq in self.stored:
            self.stored.remove(seq)
        self.stored.append(seq)
        if self.max_checkpoints is not None:
            del self.stored[: max(0, len(self.stored) - self.max_checkpoints)]


def expected_chat_hits(played: Sequence[Turn], reference: Sequence[Sequence[int]], page_size: int = 1) -> list[int]:
    """The hit of every turn of a chat played round by round, all of a round's prompts admitted in its first prefill
    step (so each sees the checkpoints of the rounds before it: the engine's default slots, prefill budget and memory
    are far more than a round needs) and no checkpoint evicted; outputs are transformers'."""
    record = CheckpointRecord(page_size)
    hits = [0] * len(played)
    for round_ in sorted({turn.round for turn in played}):
        in_round = [i for i, turn in enumerate(played) if turn.round == round_]
        for i in in_round:
            hits[i] = record.hit(played[i].prompt)
        for i in in_round:
            record.store(played[i].prompt, reference[i], hits[i])
    return hits


# ------------------------------------------------------------------------------------------------------ transformers


@functools.cache
def _reference_one(checkpoint: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    from a4.reference import hf_greedy

    return tuple(hf_greedy(checkpoint, [list(prompt)], max_new_tokens)[0])


def reference_tokens(
    checkpoint: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int = MAX_NEW_TOKENS
) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone (float32), each prompt computed once per process."""
    resolved = str(Path(checkpoint).resolve())
    return [list(_reference_one(resolved, tuple(prompt), max_new_tokens)) for prompt in prompts]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def request_problems(
    label: str, prompt: Sequence[int], output: Sequence[int], hit: int, want_tokens: Sequence[int], want_hit: int
) -> list[str]:
    """A request whose tokens differ from transformers', or whose hit is not the one the record predicts."""
    problems = []
    if hit != want_hit:
        why = "no state of that length is kept: never saved, or evicted" if hit > want_hit else "a longer one missed"
        problems.append(
            f"{label} (prompt of {len(prompt)} tokens): cached_tokens is {hit}, but the states kept allow a hit of "
            f"exactly {want_hit} ({why})"
        )
    if list(output) != list(want_tokens):
        problems.append(
            f"{label} (prompt of {len(prompt)} tokens, {hit} cached): tokens differ from transformers at output token "
            f"{_first_difference(output, want_tokens)}: a4 {list(output)}, transformers {list(want_tokens)}"
        )
    return problems


# --------------------------------------------------------------------------------------------------------- the checks


def _llm(checkpoint: str | Path, **kwargs) -> LLM:
    from a4.llm import LLM

    return LLM(checkpoint, **kwargs)


@after_notebooks(*ENGINE, "05")
def check_refuse(checkpoint: str | Path) -> None:
    """hybrid_prefix_policy="refuse": a multi-turn chat never hits, every prompt token is prefilled, tokens exact."""
    workload = chat_workload(checkpoint, conversations=2, turns=3)
    llm = _llm(checkpoint, hybrid_prefix_policy="refuse")
    played = play_chat(llm, workload)
    reference = reference_tokens(checkpoint, [turn.prompt for turn in played])
    problems = []
    for turn, want in zip(played, reference):
        label = f"conversation {turn.conversation}, turn {turn.turn}"
        problems += request_problems(label, turn.prompt, turn.output, turn.cached_tokens, want, 0)
    prompt_tokens = sum(len(turn.prompt) for turn in played)
    if llm.stats.prefill_tokens != prompt_tokens:
        problems.append(f"{llm.stats.prefill_tokens} tokens were prefilled for {prompt_tokens} prompt tokens")
    conclude(problems, f"refuse: {len(played)} chat turns, no hit, all {prompt_tokens} prompt tokens prefilled, "
                       "tokens equal to transformers'")


@after_notebooks(*ENGINE, "05")
def check_checkpoint(checkpoint: str | Path, page_size: int = 1) -> None:
    """The default policy on a multi-turn chat: each turn hits exactly at the end of the conversation's previous
    request (with page_size > 1, at the last state it saved on a page boundary)."""
    workload = chat_workload(checkpoint, conversations=3)
    llm = _llm(checkpoint, page_size=page_size, max_state_checkpoints=NO_EVICTION)
    played = play_chat(llm, workload)
    reference = reference_tokens(checkpoint, [turn.prompt for turn in played])
    problems = []
    expected = expected_chat_hits(played, reference, page_size)
    for turn, want, want_hit in zip(played, reference, expected):
        label = f"conversation {turn.conversation}, turn {turn.turn}"
        problems += request_problems(label, turn.prompt, turn.output, turn.cached_tokens, want, want_hit)
    if not any(expected):
        problems.append("the workload never allows a hit: the check checks nothing")
    saved = sum(turn.cached_tokens for turn in played)
    where = "the end of" if page_size == 1 else "the last page boundary where a state was saved in"
    conclude(problems, f"checkpoint, page_size {page_size}: {len(played)} chat turns, {saved} prompt tokens from the "
                       f"cache, each hit at {where} the conversation's previous request; tokens equal to transformers'")


def branching_requests(checkpoint: str | Path, seed: int = 1) -> list[tuple[str, list[int]]]:
    """(label, prompt) of requests to serve one at a time: a 100-token base prompt (in chunks of CHUNK = 24 it leaves
    states after 24, 48, 72, 96 and 100 tokens, and after the prompt + its output), then prompts that leave it
    before, at and after those positions, repeat it, extend it or continue its conversation."""
    rng = random.Random(seed)
    allowed = allowed_tokens(checkpoint)
    base = random_prompt(rng, allowed, 100)
    [base_output] = reference_tokens(checkpoint, [base])

    def new(n: int) -> list[int]:
        return random_prompt(rng, allowed, n)

    left_at_60 = base[:60] + new(10)
    return [
        ("the base prompt", base),
        ("the base prompt + its output + a new message", base + base_output + new(7)),
        ("leaves the base at 60 (KV matches 60 tokens)", left_at_60),
        ("leaves the base at 49", base[:49] + new(6)),
        ("the base's first 49 tokens", base[:49]),
        ("the base's first 48 tokens", base[:48]),
        ("leaves the base at 10", base[:10] + new(20)),
        ("the base prompt again", base),
        ("the base prompt + new tokens", base + new(9)),
        ("an unrelated prompt", new(30)),
        ("extends the prompt that left the base at 60", left_at_60 + new(5)),
    ]


@after_notebooks(*ENGINE, "05")
def check_hit_positions(checkpoint: str | Path, page_size: int = 1) -> None:
    """Requests served one at a time with chunked prefill: every hit is exactly the longest stored checkpoint."""
    llm = _llm(checkpoint, page_size=page_size, max_prefill_tokens=CHUNK, max_state_checkpoints=NO_EVICTION)
    requests = branching_requests(checkpoint)
    reference = reference_tokens(checkpoint, [prompt for _, prompt in requests])
    record = CheckpointRecord(page_size, prefill_budget=CHUNK)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    problems, hits = [], set()
    for (label, prompt), want in zip(requests, reference):
        out = llm.generate([prompt], params)[0]
        problems += request_problems(label, prompt, out.token_ids, out.cached_tokens, want, record.serve(prompt, want))
        hits.add(out.cached_tokens)
    conclude(problems, f"{len(requests)} requests, chunks of {CHUNK}, page_size {page_size}: hits of "
                       f"{sorted(hits - {0})} tokens, each exactly the longest stored checkpoint; tokens equal to "
                       "transformers'")


def _cache(llm: LLM):
    return llm.engine.cache_manager.prefix_cache


def snapshot_checkpoints(llm: LLM) -> dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every stored checkpoint's tensors, by the token sequence it is the state after."""
    return {
        tuple(tokens): (saved.conv.clone(), saved.recurrent.clone()) for tokens, saved in _cache(llm).checkpoints()
    }


@after_notebooks(*ENGINE, "05")
def check_immutable(checkpoint: str | Path) -> None:
    """A hit copies the checkpoint into the request's slot: the same prefix served twice gives the same tokens and
    the same hit, and the stored tensors do not change."""
    llm = _llm(checkpoint, max_prefill_tokens=CHUNK, max_state_checkpoints=NO_EVICTION)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    rng = random.Random(3)
    allowed = allowed_tokens(checkpoint)
    base = random_prompt(rng, allowed, 70)
    [base_output] = reference_tokens(checkpoint, [base])
    record = CheckpointRecord(prefill_budget=CHUNK)
    first = llm.generate([base], params)[0]
    problems = request_problems("the base prompt", base, first.token_ids, first.cached_tokens, base_output,
                                record.serve(base, base_output))
    before = snapshot_checkpoints(llm)
    if not before:
        raise CheckFailed("no checkpoint is stored after serving a 70-token prompt in chunks of 24")
    # Two branches hit the same checkpoint (after 48 tokens) in the same step, a third the base's end. The three
    # fit in one prefill step, so each sees only the checkpoints stored before it.
    branches = [base[:50] + random_prompt(rng, allowed, 8), base[:50] + random_prompt(rng, allowed, 4),
                base + base_output + random_prompt(rng, allowed, 5)]
    wants = reference_tokens(checkpoint, branches)
    for attempt in ("first", "second"):
        outputs = llm.generate(branches, params)
        want_hits = [record.hit(prompt) for prompt in branches]
        for i, (prompt, out, want, want_hit) in enumerate(zip(branches, outputs, wants, want_hits)):
            problems += request_problems(f"branch {i}, served the {attempt} time", prompt, out.token_ids,
                                         out.cached_tokens, want, want_hit)
            record.store(prompt, want, want_hit)
        after = snapshot_checkpoints(llm)
        for tokens, (conv, recurrent) in before.items():
            where = f"after serving the branches the {attempt} time, the checkpoint after {len(tokens)} tokens"
            if tokens not in after:
                problems.append(f"{where} is gone (a hit must copy it, not take it)")
            # A checkpoint is stored once and only ever copied from: equal, bit for bit.
            elif not (torch.equal(after[tokens][0], conv) and torch.equal(after[tokens][1], recurrent)):
                problems.append(f"{where} changed (a hit must copy it into the request's slot, and the request "
                                "must never write to it)")
    conclude(problems, f"{len(before)} checkpoints unchanged by 6 hits; the same prefixes served twice give the "
                       "same hits and transformers' tokens")


@after_notebooks(*ENGINE, "05")
def check_eviction(checkpoint: str | Path) -> None:
    """Checkpoints beyond max_state_checkpoints are evicted least recently used first, and never hit again; KV
    outlives its checkpoint; evicting a node's KV drops its checkpoint."""
    rng = random.Random(4)
    allowed = allowed_tokens(checkpoint)
    a, b = random_prompt(rng, allowed, 30), random_prompt(rng, allowed, 40)
    out_a, out_b = reference_tokens(checkpoint, [a, b])
    a_next, b_next = a + out_a + random_prompt(rng, allowed, 6), b + out_b + random_prompt(rng, allowed, 6)
    named = {"A": a, "B": b, "A's next turn": a_next, "B's next turn": b_next}
    # One checkpoint: only the last request's end survives. Three: A's end, hit by A's next turn after B was
    # served, is then more recently used than B's, so B's checkpoints go first.
    orders = {1: ["A", "B", "A's next turn", "B's next turn"], 3: ["A", "B", "A's next turn", "B's next turn"]}
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    problems = []
    for max_checkpoints, order in orders.items():
        llm = _llm(checkpoint, max_state_checkpoints=max_checkpoints)
        record = CheckpointRecord(max_checkpoints=max_checkpoints)
        for name, want in zip(order, reference_tokens(checkpoint, [named[name] for name in order])):
            prompt = named[name]
            out = llm.generate([prompt], params)[0]
            label = f"max_state_checkpoints={max_checkpoints}, {name}"
            problems += request_problems(label, prompt, out.token_ids, out.cached_tokens, want,
                                         record.serve(prompt, want))
            if _cache(llm).num_checkpoints > max_checkpoints:
                problems.append(f"{label}: {_cache(llm).num_checkpoints} checkpoints stored, more than the budget")
    problems += kv_eviction_problems(checkpoint)
    conclude(problems, "checkpoints beyond the budget evicted least recently used first and never hit again, "
                       "tokens equal to transformers'; evicting KV drops its checkpoint, not the reverse")


def kv_eviction_problems(checkpoint: str | Path) -> list[str]:
    """The cache alone: a checkpoint's KV evicted takes the checkpoint with it; an evicted checkpoint leaves its KV."""
    from a4.kvcache.hybrid_radix_cache import HybridRadixCache
    from a4.kvcache.radix_cache import RadixCache
    from a4.kvcache.state_pool import StatePool
    from a4.models.config import parse_config

    pool = StatePool(parse_config(read_config(checkpoint)), 2, torch.float32, "cpu")
    problems = []
    cache = HybridRadixCache(1, pool, max_checkpoints=1)
    first, second = list(range(10, 20)), list(range(30, 40))
    cache.insert_prefix(first, torch.arange(10))
    cache.save_state(first, 0)
    cache.insert_prefix(second, torch.arange(10, 20))
    cache.save_state(second, 1)
    if cache.match_prefix(first + [1]).handle.cached_len != 0:
        problems.append("the cache alone: a checkpoint evicted by the budget is still hit")
    if RadixCache.match_prefix(cache, first + [1]).handle.cached_len != len(first):
        problems.append("the cache alone: evicting a checkpoint also dropped its KV (KV may outlive its state)")
    cache.evict(cache.evictable_size)
    if cache.num_checkpoints != 0 or cache.match_prefix(second + [1]).handle.cached_len != 0:
        problems.append("the cache alone: after evicting all KV, a checkpoint is still stored or hit")
    return problems
