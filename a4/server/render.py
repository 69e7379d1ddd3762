"""The response bodies of the two generation routes: a whole response, and the chunks of a streamed one. With a
LogprobsFormatter (the request asked for logprobs), each choice and chunk carries its tokens' logprobs."""

from __future__ import annotations

from collections import defaultdict

from pydantic import BaseModel

from a4.server.logprobs import LogprobsFormatter, Scored
from a4.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)


class CompletionRender:
    """/v1/completions' bodies: `n` choices per prompt, each with its index (prompt i's sample j: i * n + j)."""

    def __init__(self, request_id: str, model: str, logprobs: LogprobsFormatter | None = None) -> None:
        self.request_id, self.model, self.logprobs = request_id, model, logprobs
        # Streamed: each choice's text so far, where its next token's text_offset starts.
        self._text_lens: defaultdict[int, int] = defaultdict(int)

    def response(
        self, choices: list[tuple[str, str]], usage: UsageInfo, logprobs: list[Scored] | None = None
    ) -> CompletionResponse:
        """`choices`: each choice's text and finish reason, in order; `logprobs`: each one's scored tokens."""
        bodies = [CompletionChoice(index=i, text=text, finish_reason=why) for i, (text, why) in enumerate(choices)]
        if self.logprobs is not None:
            for body, scored in zip(bodies, logprobs, strict=True):
                body.logprobs = self.logprobs.completion(scored)
        return CompletionResponse(id=self.request_id, model=self.model, choices=bodies, usage=usage)

    def opening_chunk(self, usage: UsageInfo | None) -> BaseModel | None:
        return None

    def chunk(self, index: int, text: str, finish_reason: str | None, usage: UsageInfo | None,
              logprobs: Scored = ()) -> CompletionResponse:  # fmt: skip
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.completion(logprobs, self._text_lens[index])
        self._text_lens[index] += len(text)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)


class ChatRender:
    """/v1/chat/completions' bodies (`n` choices); a stream opens with the assistant's role for each, as OpenAI's
    does."""

    def __init__(self, request_id: str, model: str, n: int = 1, logprobs: LogprobsFormatter | None = None) -> None:
        self.request_id, self.model, self.n, self.logprobs = request_id, model, n, logprobs

    def response(
        self, choices: list[tuple[str, str]], usage: UsageInfo, logprobs: list[Scored] | None = None
    ) -> ChatCompletionResponse:
        bodies = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish_reason)
                  for i, (text, finish_reason) in enumerate(choices)]  # fmt: skip
        if self.logprobs is not None:
            for body, scored in zip(bodies, logprobs, strict=True):
                body.logprobs = self.logprobs.chat(scored)
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=bodies, usage=usage)

    def opening_chunk(self, usage: UsageInfo | None) -> ChatCompletionChunk:
        """The assistant's role, for every choice."""
        choices = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(self.n)]
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def chunk(self, index: int, text: str, finish_reason: str | None, usage: UsageInfo | None,
              logprobs: Scored = ()) -> ChatCompletionChunk:  # fmt: skip
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text or None), finish_reason=finish_reason)
        if self.logprobs is not None:
            choice.logprobs = self.logprobs.chat(logprobs)
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)


Render = CompletionRender | ChatRender
