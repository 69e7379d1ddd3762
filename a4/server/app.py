"""The HTTP side: FastAPI routes in OpenAI's shapes, over the engine loop.

    GET  /v1/models            the one model served
    GET  /v1/models/{id}       it, by name
    POST /v1/completions       prompts as text or token ids, one choice each
    POST /v1/chat/completions  messages, rendered by the checkpoint's chat template (prompts.py)
    POST /tokenize             a text or messages as the two routes above encode them (vLLM's route and bodies)
    POST /detokenize           token ids as text
    GET  /health               200 while the engine loop runs
    GET  /metrics              Prometheus text (metrics.py)

A generation request is tokenized in a worker thread (so that the event loop keeps serving meanwhile), its
`response_format` compiled there too (a4/engine/grammar.py: a schema once, then from xgrammar's cache), and checked
here (the engine's own `prompt_error`: empty, outside the vocabulary, longer than the context); each sample of each
prompt (`n`) is one engine request (the samples of a prompt share its prefill), submitted to the engine loop, whose
text comes back as it becomes final (the loop detokenizes and applies the stop strings). The response waits for the
first piece of every prompt, so that a request the engine refuses is still a plain 400; then it is one JSON body, or
with `stream: true` server-sent events ending in `data: [DONE]`. A client that disconnects, while waiting or while
streaming, aborts its requests. Logprobs come with the pieces they belong to (logprobs.py writes them in OpenAI's
shapes); a completion with `echo` opens each choice with its prompt, and its prompt's logprobs when it asks for
logprobs.

Errors are OpenAI's shape (errors.py): 400 for a bad body, 401 without the API key (auth.py), 404 for an unknown
model or route, 408 / 413 for a body too slow or too large (limits.py), 503 with Retry-After when the engine loop's
bound is reached or it is shutting down (a request it held then is aborted with a 503: no fault of the request's),
500 if the engine fails a request after it started.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from a4.core import SamplingParams, TokenLogprobs
from a4.engine.grammar import GrammarBackend, grammar_error
from a4.engine.validation import prompt_error
from a4.server.auth import APIKeyMiddleware
from a4.server.engine_loop import EngineLoop, RequestStream, Unavailable
from a4.server.errors import APIError, unavailable
from a4.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT, RequestLimitsMiddleware
from a4.server.logprobs import LogprobsFormatter, Scored
from a4.server.prompts import PromptEncoder
from a4.server.protocol import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    ResponseFormat,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UsageInfo,
)
from a4.server.render import ChatRender, CompletionRender, Render

# What nginx logs for a client that closed its connection before the response; nobody receives it.
CLIENT_CLOSED_REQUEST = 499

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


@dataclass(frozen=True)
class Piece:
    """Text of a request that is final, its usage so far, and with the last piece, why it ended. With logprobs asked
    for: those of the tokens it counts anew, and in the first piece the prompt's (the first None)."""

    text: str
    usage: UsageInfo
    finish_reason: str | None = None
    logprobs: Scored = ()
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Pieces:
    """One engine request's text, piece by piece; `close` aborts the request unless it has finished (a client gone,
    another prompt of the same request refused). Awaiting `next` may be cancelled at any time."""

    def __init__(self, engine_loop: EngineLoop, stream: RequestStream, num_prompt_tokens: int) -> None:
        self._engine_loop, self._stream, self._num_prompt_tokens = engine_loop, stream, num_prompt_tokens
        self._num_tokens = 0
        self.finished = False

    async def next(self) -> Piece:
        output = await self._stream.get()
        self.finished = output.finish_reason is not None
        if output.finish_reason in ("error", "abort"):
            raise self._failed(output.finish_reason, output.error)
        self._num_tokens = output.num_tokens
        usage = UsageInfo.of(self._num_prompt_tokens, output.num_tokens, output.cached_tokens)
        logprobs = [(entry.token_id, entry) for entry in output.logprobs]
        return Piece(output.text, usage, FINISH_REASONS.get(output.finish_reason), logprobs, output.prompt_logprobs)

    async def rest(self, first: Piece) -> list[Piece]:
        """The pieces after `first` (none if `first` was the last)."""
        pieces = [first]
        while pieces[-1].finish_reason is None:
            pieces.append(await self.next())
        return pieces[1:]

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self._stream)

    def _failed(self, reason: str, error: str | None) -> APIError:
        if self._engine_loop.stopping:  # aborted by the shutdown, through no fault of its own: retriable
            return unavailable(error or "the server is shutting down")
        # Refused before any token: the request was bad (400). Later, or aborted: the engine failed it.
        if reason == "error" and self._num_tokens == 0:
            return APIError(400, error or "the request was refused")
        return APIError(500, error or "the request was aborted", type="server_error")


def create_app(
    engine_loop: EngineLoop, tokenizer, model_name: str, *, api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    enable_special_tokens_in_messages: bool = False,
) -> FastAPI:  # fmt: skip
    """The server of one model: `tokenizer` is its transformers tokenizer (with the chat template). `api_key`: the
    key /v1/ routes require (None: none); the limits on a request's body (limits.py); whether special-token text in
    chat messages is read as special tokens (prompts.py)."""
    engine = engine_loop.engine
    encoder = PromptEncoder(tokenizer, enable_special_tokens_in_messages)
    grammars = GrammarBackend(tokenizer, engine.model_config.vocab_size, engine.model_config.eos_token_ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        yield
        await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="a4", lifespan=lifespan)
    app.state.engine_loop = engine_loop  # for tests and notebooks: the engine behind the app
    app.state.prompt_encoder = encoder
    app.state.request_timeout = request_timeout  # for uvicorn's protocol (launch.uvicorn_config)
    app.add_middleware(RequestLimitsMiddleware, max_bytes=max_request_bytes, timeout=request_timeout)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # outermost: a request without the key reads nothing

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
    async def busy(request: Request, error: Unavailable) -> JSONResponse:
        return unavailable(str(error)).response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine_loop.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(engine_loop.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, max_model_len=engine.max_context_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if len(body.prompts) * body.n > engine_loop.capacity:
            raise APIError(400, f"prompt: {len(body.prompts)} prompts of {body.n} samples in one request, more than the "
                                f"server holds at once ({engine_loop.capacity}): send fewer", param="prompt")  # fmt: skip
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: must be at least 1 (0 only with echo: true, the prompt alone)",
                           param="max_tokens")  # fmt: skip
        prompts = [await run_in_threadpool(checked_prompt, encoder.text if isinstance(p, str) else list, p)
                   for p in body.prompts]  # fmt: skip
        formatter = logprobs_formatter(body.logprobs)
        render = CompletionRender(f"cmpl-{uuid.uuid4().hex}", model_name, formatter)
        echoes = None
        if body.echo:
            texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts, prompts)]
            echoes = [Echo(ids, text, body.echo_only) for ids, text in zip(prompts, texts)]
        # OpenAI's default for completions: 16 tokens.
        return await respond(request, body, prompts, render, default_max_tokens=16, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        if not encoder.has_chat_template:
            raise APIError(400, f"model {model_name!r} has no chat template: use /v1/completions", param="messages")
        messages = [message.template_message() for message in body.messages]
        prompt = await run_in_threadpool(checked_prompt, encoder.chat, messages, param="messages")
        render = ChatRender(f"chatcmpl-{uuid.uuid4().hex}", model_name, body.n,
                            logprobs_formatter((body.top_logprobs or 0) if body.logprobs else None))  # fmt: skip
        # OpenAI's default for chat: up to the context's end (the engine stops there).
        return await respond(request, body, [prompt], render, default_max_tokens=engine.max_context_len)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body()) -> TokenizeResponse:
        # vLLM's two bodies, told apart by their prompt field (a union's errors would name both models).
        parsed = validated(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        check_model(parsed.model)
        if isinstance(parsed, TokenizeChatRequest):
            if not encoder.has_chat_template:
                raise APIError(400, f"model {model_name!r} has no chat template", param="messages")
            messages = [message.template_message() for message in parsed.messages]
            ids = await run_in_threadpool(encoded, encoder.chat, messages, parsed.add_generation_prompt,
                                          param="messages")  # fmt: skip
        else:
            ids = await run_in_threadpool(encoded, encoder.text, parsed.prompt, parsed.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_context_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        vocab_size = engine.model_config.vocab_size
        if (bad := next((t for t in body.tokens if not 0 <= t < vocab_size), None)) is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=await run_in_threadpool(tokenizer.decode, body.tokens))

    def logprobs_formatter(top: int | None) -> LogprobsFormatter | None:
        return None if top is None else LogprobsFormatter(tokenizer.backend_tokenizer, top)

    def encoded(encode, prompt, *options, param: str = "prompt") -> list[int]:
        """encode(prompt, *options), a ValueError of its as a 400 naming `param`."""
        try:
            return encode(prompt, *options)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_prompt") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404, f"the model {name!r} does not exist: this server serves {model_name!r}",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip

    def checked_prompt(encode, prompt, param: str = "prompt") -> list[int]:
        """The prompt's ids, checked as the engine will (in a worker thread: a long prompt takes a while)."""
        prompt_ids = encoded(encode, prompt, param=param)
        error = prompt_error(prompt_ids, engine.model_config, engine.max_context_len, engine.memory_plan.num_tokens)
        if error is not None:
            code = "context_length_exceeded" if len(prompt_ids) >= engine.max_context_len else "invalid_prompt"
            raise APIError(400, error, param=param, code=code)
        return prompt_ids

    def checked_sampling_params(body: GenerationRequest, default_max_tokens: int) -> SamplingParams:
        """The body's SamplingParams, checked as the engine will (a 400 naming the field)."""
        max_new_tokens = body.max_new_tokens or default_max_tokens
        if body.min_tokens > max_new_tokens:
            raise APIError(400, f"min_tokens: must be at most max_tokens ({max_new_tokens}), got {body.min_tokens}",
                           param="min_tokens")  # fmt: skip
        params = body.sampling_params(default_max_tokens)
        if (error := engine.sampling_error(params)) is not None:
            field = error.split(":")[0]
            raise APIError(400, error, param=field if field in GenerationRequest.model_fields else None)
        return params

    def compiled_grammar(response_format: ResponseFormat):
        """The grammar of a JSON response_format (in a worker thread: a new schema takes a while to compile)."""
        try:
            if response_format.type == "json_object":
                return grammars.json_object()
            return grammars.json_schema(response_format.json_schema.json_schema)
        except ValueError as e:
            param = "response_format.json_schema.schema"
            raise APIError(400, f"{param}: invalid JSON schema: {e}", param=param, code="invalid_schema") from None

    async def respond(
        request: Request, body: GenerationRequest, prompts: list[list[int]], render: Render, default_max_tokens: int,
        echoes: list[Echo] | None = None,
    ) -> Response:  # fmt: skip
        params = checked_sampling_params(body, default_max_tokens)
        if body.response_format is not None and body.response_format.type != "text":
            params = replace(params, grammar=await run_in_threadpool(compiled_grammar, body.response_format))
            # What the engine would refuse, as a 400 naming the field.
            if error := grammar_error(params, engine.model_config):
                raise APIError(400, f"response_format: {error}", param="response_format")
        pieces: list[Pieces] = []
        streaming = False  # once the stream's generator has the requests, it closes them
        try:
            for prompt_ids in prompts:
                for stream in engine_loop.submit(prompt_ids, params, body.stop_strings):
                    pieces.append(Pieces(engine_loop, stream, len(prompt_ids)))
            firsts = await until_disconnected(request, all_of(p.next() for p in pieces))
            if echoes is not None:
                # A prompt's echo opens each of its n choices.
                firsts = [echo.opening(first) for echo, first in zip((e for e in echoes for _ in range(body.n)), firsts)]
            if not body.stream:
                rests = await until_disconnected(request, all_of(map(Pieces.rest, pieces, firsts)))
                wholes = [[first, *rest] for first, rest in zip(firsts, rests)]
                texts = ["".join(piece.text for piece in whole) for whole in wholes]
                choices = [(text, whole[-1].finish_reason) for text, whole in zip(texts, wholes)]
                logprobs = [[scored for piece in whole for scored in piece.logprobs] for whole in wholes]
                usage = UsageInfo.total([whole[-1].usage for whole in wholes], body.n)
                return JSONResponse(render.response(choices, usage, logprobs).model_dump())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except APIError as error:
            return error.response()
        else:
            streaming = True
            events = server_sent_events(render, firsts, pieces, body.include_usage, body.continuous_usage, body.n)
            return StreamingResponse(events, media_type="text/event-stream")
        finally:
            if not streaming:
                for p in pieces:
                    p.close()

    return app


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, opening its choice (`echo`)."""

    prompt_ids: list[int]
    text: str
    only: bool  # max_tokens 0: the prompt alone, the token the engine sampled dropped

    def opening(self, first: Piece) -> Piece:
        """The choice's first piece with the prompt's text and logprobs before it; with `only`, the prompt alone (the
        first piece is then the last: the engine generated one token)."""
        prompt = []
        if first.prompt_logprobs is not None:
            prompt = list(zip(self.prompt_ids, first.prompt_logprobs, strict=True))
        if self.only:
            usage = first.usage
            usage = UsageInfo.of(usage.prompt_tokens, 0, usage.prompt_tokens_details.cached_tokens)
            return Piece(self.text, usage, "length", prompt)
        return Piece(self.text + first.text, first.usage, first.finish_reason, [*prompt, *first.logprobs])


async def all_of(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """The results of all, or the first exception, after which those still running are cancelled."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it (which aborts its requests) and raise
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


async def merged(firsts: list[Piece], pieces: list[Pieces]) -> AsyncIterator[tuple[int, Piece]]:
    """Every request's pieces, `firsts` then the rest, each with its request's index, as they come."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for index, first in enumerate(firsts):
            yield index, first
            if first.finish_reason is None:
                pending[asyncio.ensure_future(pieces[index].next())] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                yield index, (piece := task.result())
                if piece.finish_reason is None:
                    pending[asyncio.ensure_future(pieces[index].next())] = index
    finally:
        for task in pending:
            task.cancel()


async def server_sent_events(
    render: Render, firsts: list[Piece], pieces: list[Pieces], include_usage: bool, continuous_usage: bool, n: int
):
    """`data: <chunk>` events, an error event if the engine fails a request midway, then `data: [DONE]`. With
    `continuous_usage`, every chunk carries its request's usage so far (vLLM's `continuous_usage_stats`)."""

    def event(chunk: BaseModel) -> str:
        return f"data: {chunk.model_dump_json()}\n\n"

    def usage(piece: Piece) -> UsageInfo | None:
        return piece.usage if continuous_usage else None

    lasts = list(firsts)
    events = merged(firsts, pieces)
    try:
        first_usage = firsts[0].usage
        opening = UsageInfo.of(first_usage.prompt_tokens, 0, first_usage.prompt_tokens_details.cached_tokens)
        if (chunk := render.opening_chunk(opening if continuous_usage else None)) is not None:
            yield event(chunk)
        async for index, piece in events:
            lasts[index] = piece
            yield event(render.chunk(index, piece.text, piece.finish_reason, usage(piece), piece.logprobs))
        if include_usage:
            yield event(render.usage_chunk(UsageInfo.total([last.usage for last in lasts], n)))
    except APIError as error:
        yield event(ErrorResponse(error=error.info))
    finally:
        # Starlette abandons this generator when the client disconnects: the requests still running are aborted.
        await events.aclose()
        for p in pieces:
            p.close()
    yield "data: [DONE]\n\n"


def validated(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """body as `model`, or the 400 of a body FastAPI had checked against it."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


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
