"""The OpenAI API's bodies, as much of them as a4 serves: pydantic models of requests (checked on arrival) and
responses.

Requests are strict: a field of the wrong type (`"max_tokens": "10"`), out of range (`max_tokens` <= 0, a
non-finite `temperature`) or unknown (a typo such as `max_token`) is refused with a 400 naming it, never coerced
or ignored. `ignore_eos` and `top_k` are the extensions SGLang and vLLM accept too. One prompt and one choice per
request (`n` = 1).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from a4.core import SamplingParams

# The engine's reasons (a4.core.FinishReason) in OpenAI's words; "error" and "abort" become errors instead.
FINISH_REASONS = {"eos": "stop", "length": "length"}
MAX_SEED = 2**63 - 1  # SamplingParams' bound


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationRequest(StrictModel):
    """What completions and chat completions share: the model, sampling and streaming."""

    model: str | None = None  # None: the one model served
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # extension; 0: no top-k cut
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate max_tokens whatever the model says (benchmarks)
    n: int = 1

    @model_validator(mode="after")
    def _supported(self) -> GenerationRequest:
        if self.n != 1:
            raise ValueError(f"n = {self.n} is not supported: a4 returns one choice per request (n = 1)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if any(stop == "" for stop in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = Field(min_length=1)  # text, or token ids

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_token_ids(cls, prompt: object) -> object:
        # Checked before the union, whose own errors would name each of its members in turn.
        is_token_ids = isinstance(prompt, list) and all(type(token) is int for token in prompt)
        if not (isinstance(prompt, str) or is_token_ids):
            raise ValueError(f"must be text or a list of token ids (integers), got {prompt!r:.60}")
        return prompt


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name for max_tokens

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self


# ---------------------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served by the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Response(BaseModel):
    """What every response of the completion endpoints carries: its id, when it was made, the model's name."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(Response):
    """A completion, or one chunk of a streamed one (the same object, as in OpenAI's API)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "a4"
    max_model_len: int  # the longest request (prompt + output), as vLLM reports it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
