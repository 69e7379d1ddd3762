"""The HTTP side: FastAPI routes in OpenAI's shapes, over the engine loop.

    GET  /v1/models            the one model served
    POST /v1/completions       prompt as text or token ids
    POST /v1/chat/completions  messages, rendered by the checkpoint's chat template
    GET  /health               200 while the engine loop runs
    GET  /metrics              Prometheus text (metrics.py)

A generation request is tokenized and checked here (the engine's own `prompt_error`: empty, outside the vocabulary,
longer than the context), submitted to the engine loop, and its tokens come back as text pieces from the
incremental detokenizer, which also applies the stop strings (the engine has none: a stop string found aborts the
engine's request and finishes with "stop"). The response waits for the first piece, so that a request the engine
refuses is still a plain 400; then it is one JSON body, or with `stream: true` server-sent events ending in
`data: [DONE]`. A client that disconnects, while waiting or while streaming, aborts its request.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body, 404 for an
unknown model or route, 503 with Retry-After when the engine loop's bound is reached (or it is stopping), 500 if
the engine fails a request after it started.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from a4.engine.validation import prompt_error
from a4.server.detokenizer import IncrementalDetokenizer
from a4.server.engine_loop import EngineLoop, RequestStream, Unavailable
from a4.server.protocol import (
    FINISH_REASONS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    UsageInfo,
)

RETRY_AFTER_SECONDS = 1
# What nginx logs for a client that closed its connection before the response; nobody receives it.
CLIENT_CLOSED_REQUEST = 499

T = TypeVar("T")


class APIError(Exception):
    """An error response: status, and the fields of OpenAI's error object."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


@dataclass(frozen=True)
class Piece:
    """Text of a request that is final, and with the last piece, why it ended and the usage."""

    text: str
    finish_reason: str | None = None
    usage: UsageInfo | None = None


def create_app(engine_loop: EngineLoop, tokenizer, model_name: str) -> FastAPI:
    """The server of one model: `tokenizer` is its transformers tokenizer (with the chat template)."""
    engine = engine_loop.engine
    backend_tokenizer = tokenizer.backend_tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="a4", lifespan=lifespan)
    app.state.engine_loop = engine_loop  # for tests and notebooks: the engine behind the app

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), type=kind).response()

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, error: Unavailable) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(503, str(error), type="server_error", code="server_busy", headers=headers).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine_loop.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine_loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_context_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        render = CompletionRender(f"cmpl-{uuid.uuid4().hex}", model_name)
        # OpenAI's default for completions: 16 tokens.
        return await respond(request, body, prompt_ids, "prompt", render, default_max_tokens=16)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        if tokenizer.chat_template is None:
            raise APIError(400, f"model {model_name!r} has no chat template: use /v1/completions", param="messages")
        messages = [message.model_dump() for message in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens itself.
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        render = ChatRender(f"chatcmpl-{uuid.uuid4().hex}", model_name)
        # OpenAI's default for chat: up to the context's end (the engine stops there).
        return await respond(request, body, prompt_ids, "messages", render, default_max_tokens=engine.max_context_len)

    def check_model(body: GenerationRequest) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404, f"the model {body.model!r} does not exist: this server serves {model_name!r}",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip

    async def respond(
        request: Request, body: GenerationRequest, prompt_ids: list[int], param: str, render: Render,
        default_max_tokens: int,
    ) -> Response:  # fmt: skip
        error = prompt_error(prompt_ids, engine.model_config, engine.max_context_len, engine.memory_plan.num_tokens)
        if error is not None:
            code = "context_length_exceeded" if len(prompt_ids) >= engine.max_context_len else "invalid_prompt"
            raise APIError(400, error, param=param, code=code)
        stream = engine_loop.submit(prompt_ids, body.sampling_params(default_max_tokens))
        pieces = text_pieces(stream, body.stop_strings, len(prompt_ids))
        try:
            first = await until_disconnected(request, anext(pieces))
            if not body.stream:
                rest = await until_disconnected(request, collect(pieces, first))
                text = "".join(piece.text for piece in [first, *rest])
                last = rest[-1] if rest else first
                return JSONResponse(render.response(text, last.finish_reason, last.usage).model_dump())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except APIError as error:
            return error.response()
        return StreamingResponse(server_sent_events(render, first, pieces, body.include_usage),
                                 media_type="text/event-stream")  # fmt: skip

    async def text_pieces(stream: RequestStream, stop: list[str], num_prompt_tokens: int) -> AsyncIterator[Piece]:
        """The request's text as it becomes final; the engine's request is aborted if this ends early (a client
        gone, a stop string)."""
        detokenizer = IncrementalDetokenizer(backend_tokenizer, stop)
        engine_finished = False
        try:
            async for output in stream:
                engine_finished = output.finish_reason is not None
                if output.finish_reason in ("error", "abort"):
                    # Refused before any token: the request was bad (400). Later: the engine failed it.
                    started = detokenizer.num_tokens > 0 or output.finish_reason == "abort"
                    raise APIError(500 if started else 400, output.error or "the request was aborted",
                                   type="server_error" if started else "invalid_request_error")  # fmt: skip
                text = detokenizer.add(output.token_ids)
                if detokenizer.stopped:
                    finish_reason = "stop"
                elif engine_finished:
                    finish_reason = FINISH_REASONS[output.finish_reason]
                    text += detokenizer.finish()
                else:
                    if text:
                        yield Piece(text)
                    continue
                usage = UsageInfo.of(num_prompt_tokens, detokenizer.num_tokens, output.cached_tokens)
                yield Piece(text, finish_reason, usage)
                return
        finally:
            if not engine_finished:
                engine_loop.abort(stream)

    return app


async def collect(pieces: AsyncIterator[Piece], first: Piece) -> list[Piece]:
    """The pieces after `first` (none if `first` was the last)."""
    return [] if first.finish_reason is not None else [piece async for piece in pieces]


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it (which aborts its request) and raise
    ClientGone. (While a streamed response is being sent, Starlette watches for the disconnect itself.)"""

    async def disconnected() -> None:
        # The body has been read: the next message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work_task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work_task.done():
        work_task.cancel()
        raise ClientGone()
    return work_task.result()


async def server_sent_events(render: Render, first: Piece, pieces: AsyncIterator[Piece], include_usage: bool):
    """`data: <chunk>` events, an error event if the engine fails the request midway, then `data: [DONE]`."""

    def event(chunk: BaseModel) -> str:
        return f"data: {chunk.model_dump_json()}\n\n"

    try:
        for chunk in render.opening_chunks():
            yield event(chunk)
        piece = first
        while True:
            yield event(render.chunk(piece.text, piece.finish_reason))
            if piece.finish_reason is not None:
                break
            piece = await anext(pieces)
        if include_usage:
            yield event(render.usage_chunk(piece.usage))
    except APIError as error:
        yield event(ErrorResponse(error=error.info))
    finally:
        # Starlette abandons this generator when the client disconnects; closing `pieces` aborts the request.
        await pieces.aclose()
    yield "data: [DONE]\n\n"


def validation_error(error: RequestValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    problem = error.errors()[0]
    if problem["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {problem.get('ctx', {}).get('error', problem['msg'])}",
                        code="invalid_json")  # fmt: skip
    location = [str(part) for part in problem["loc"] if part != "body"]
    param = ".".join(location) or None
    message = problem["msg"].removeprefix("Value error, ")
    if param is not None:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code=problem["type"])


# ------------------------------------------------------------------------------------------- response shapes


class CompletionRender:
    """/v1/completions' bodies: the response, and the chunks of a streamed one."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model

    def response(self, text: str, finish_reason: str, usage: UsageInfo) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(id=self.request_id, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=usage)


class ChatRender:
    """/v1/chat/completions' bodies; a stream opens with the assistant's role, as OpenAI's does."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model = request_id, model

    def response(self, text: str, finish_reason: str, usage: UsageInfo) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(DeltaMessage(role="assistant", content=""), None)]

    def chunk(self, text: str, finish_reason: str | None) -> ChatCompletionChunk:
        return self._chunk(DeltaMessage(content=text or None), finish_reason)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=usage)

    def _chunk(self, delta: DeltaMessage, finish_reason: str | None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice])


Render = CompletionRender | ChatRender
