"""EngineStats: what an engine has done since it was built, as counters (`llm.stats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine was built; tokens are prompt tokens (prefill) or generated tokens (decode). Steps and
    prompt tokens are counted when a step is launched, generated tokens when it is booked (under overlap scheduling,
    in the engine's next call)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model
    cached_tokens: int = 0  # prompt tokens served by the prefix cache instead (counted when a request finishes)
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Speculative decoding: decode steps counted per request, drafts verified, drafts accepted.
    decode_request_steps: int = 0
    # Mixed steps (counted as prefill steps too, their seconds as prefill seconds) and the tokens their decoding
    # requests gained.
    mixed_steps: int = 0
    mixed_decode_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Of the drafted tokens, the share greedy verification accepted."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        """Tokens a request gains per decode step: 1 without speculation, up to k + 1 with it."""
        return self.decode_tokens / self.decode_request_steps if self.decode_request_steps else 0.0

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
