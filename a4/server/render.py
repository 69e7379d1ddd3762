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
    """/v1/completions' bodies: one choice per prompt, each with its index."""

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
    """/v1/chat/completions' bodies (one choice); a stream opens with the assistant's role, as OpenAI's does."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model

    def response(self, choices: list[tuple[str, str]], usage: UsageInfo) -> ChatCompletionResponse:
        [(text, finish_reason)] = choices
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def opening_chunk(self, usage: UsageInfo | None) -> ChatCompletionChunk:
        return self._chunk(DeltaMessage(role="assistant", content=""), None, usage)

    def chunk(self, index: int, text: str, finish_reason: str | None, usage: UsageInfo | None) -> ChatCompletionChunk:
        return self._chunk(DeltaMessage(content=text or None), finish_reason, usage)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None, usage: UsageInfo | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)


Render = CompletionRender | ChatRender
