"""The response bodies of the two generation routes: a whole response, and the chunks of a streamed one."""

from __future__ import annotations

from pydantic import BaseModel

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

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model

    def response(self, choices: list[tuple[str, str]], usage: UsageInfo) -> CompletionResponse:
        """`choices`: each prompt's text and finish reason, in order."""
        bodies = [CompletionChoice(index=i, text=text, finish_reason=why) for i, (text, why) in enumerate(choices)]
        return CompletionResponse(id=self.request_id, model=self.model, choices=bodies, usage=usage)

    def opening_chunk(self, usage: UsageInfo | None) -> BaseModel | None:
        return None

    def chunk(self, index: int, text: str, finish_reason: str | None, usage: UsageInfo | None) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)


class ChatRender:
    """/v1/chat/completions' bodies (`n` choices); a stream opens with the assistant's role for each, as OpenAI's
    does."""

    def __init__(self, request_id: str, model: str, n: int = 1) -> None:
        self.request_id, self.model, self.n = request_id, model, n

    def response(self, choices: list[tuple[str, str]], usage: UsageInfo) -> ChatCompletionResponse:
        bodies = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish_reason)
                  for i, (text, finish_reason) in enumerate(choices)]  # fmt: skip
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=bodies, usage=usage)

    def opening_chunk(self, usage: UsageInfo | None) -> ChatCompletionChunk:
        """The assistant's role, for every choice."""
        choices = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(self.n)]
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, usage=usage)

    def chunk(self, index: int, text: str, finish_reason: str | None, usage: UsageInfo | None) -> ChatCompletionChunk:
        return self._chunk(DeltaMessage(content=text or None), finish_reason, usage, index)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None, usage: UsageInfo | None,
               index: int = 0) -> ChatCompletionChunk:  # fmt: skip
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)


Render = CompletionRender | ChatRender
