"""The OpenAI API's bodies, as much of them as a4 serves: pydantic models of requests (checked on arrival) and
responses.

Requests are strict: a field of the wrong type (`"max_tokens": "10"`), out of range (`max_tokens` <= 0, a
non-finite `temperature`, a `top_p` that float32 rounds to 0), unknown (a typo such as `max_token`) or text that is
not valid Unicode (a lone surrogate, `"\\ud800"`) is refused with a 400 naming it, never coerced or ignored; so are
the fields a4 does not implement yet (`best_of` other than n), each saying so. `ignore_eos`, `top_k`,
`repetition_penalty`, `min_p`, `min_tokens`, `stop_token_ids` and `stream_options.continuous_usage_stats` are the
extensions SGLang and vLLM accept too. `response_format` (structured output: text, any JSON object, or JSON valid
against a schema) is taken by both routes, as vLLM does; vLLM's older `guided_json` is not (vLLM has dropped it too).
A completion's `prompt` may be several prompts (texts, or lists of token ids), `n` choices each. Log-probabilities
(completions: `logprobs: k`, with `echo` the prompt's too; chat: `logprobs: true, top_logprobs: k`) list at most
MAX_LOGPROBS most likely tokens, vLLM's default bound. `/tokenize` and `/detokenize` take vLLM's bodies.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from a4.core import SamplingParams

# The engine's reasons (a4.core.FinishReason) in OpenAI's words; "error" and "abort" become errors instead.
FINISH_REASONS = {"eos": "stop", "length": "length", "stop": "stop"}
MAX_SEED = 2**63 - 1  # SamplingParams' bound
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs, and vLLM's default max_logprobs


def _unicode_text(text: str) -> str:
    """JSON can carry half of a UTF-16 surrogate pair (`"\\ud800"`), which is no character: no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}") from None
    return text


def _not_supported(detail: str = "") -> ValueError:
    """A field a4 does not implement yet (the message is prefixed with the field's name)."""
    return ValueError(f"not supported by a4 yet{detail}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")
    # Whether the output must follow the schema exactly: a4 always makes it (as vLLM does).
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


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
    n: int = Field(1, ge=1)
    best_of: int | None = None  # refused beyond n, as vLLM V1 does
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    # vLLM's and SGLang's extensions (SamplingParams says what each does).
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    # Token ids (as strings, JSON's keys) to a bias added to their logits, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end user's id, for the provider's abuse monitoring: accepted, unused
    response_format: ResponseFormat | None = None

    @field_validator("top_p")
    @classmethod
    def _positive_in_float32(cls, top_p: float) -> float:
        # The sampler compares probabilities with top_p in float32, where a smaller value is 0: nothing would pass.
        if np.float32(top_p) < np.finfo(np.float32).tiny:
            raise ValueError(f"must be at least {np.finfo(np.float32).tiny:.3g} (the sampler works in float32)")
        return top_p

    @field_validator("stop", mode="before")
    @classmethod
    def _unicode_stop(cls, stop: object) -> object:
        # Before the union, whose errors would name its members.
        for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
            if isinstance(text, str):
                _unicode_text(text)
        return stop

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n"):
            raise _not_supported(f" (vLLM V1 refuses it too): n samples are all returned; got best_of {best_of}")
        return best_of

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, token_ids: list[int] | None) -> list[int] | None:
        if token_ids is not None and any(token < 0 for token in token_ids):
            raise ValueError(f"token ids are >= 0, got {token_ids}")
        return token_ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (logit_bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"keys are token ids (integers, as strings), got {token!r}")
            if bias != bias or abs(bias) == float("inf"):
                raise ValueError(f"the bias of token {token} must be finite, got {bias}")
        return logit_bias

    @field_validator("response_format")
    @classmethod
    def _grammar_ends_at_eos(
        cls, response_format: ResponseFormat | None, info: ValidationInfo
    ) -> ResponseFormat | None:
        if response_format is not None and response_format.type != "text" and info.data.get("ignore_eos"):
            raise ValueError("cannot be combined with ignore_eos: the JSON ends with an end-of-sequence token")
        return response_format

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens or default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logit_bias={int(token): min(100.0, max(-100.0, bias)) for token, bias in self.logit_bias.items()}
            if self.logit_bias else None,
            n=self.n,
        )


Prompt = str | list[int]  # text, or token ids


class CompletionRequest(GenerationRequest):
    # One prompt (text or token ids) or several (a list of texts, or of lists of token ids): one choice each.
    prompt: Prompt | list[Prompt]
    # Each token's logprob and the `logprobs` most likely tokens'; with `echo`, the prompt's tokens' too.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt before the completion in each choice's text (and logprobs). With max_tokens 0, the prompt alone:
    # lm-eval's log-likelihood requests (the engine samples one token, dropped, as vLLM does).
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (`echo_only`)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_or_more_prompts(cls, prompt: object) -> object:
        # Checked before the union, whose own errors would name each of its members in turn.
        def is_token_ids(value: object) -> bool:
            return isinstance(value, list) and all(type(token) is int for token in value)

        several = isinstance(prompt, list) and all(isinstance(one, str) or is_token_ids(one) for one in prompt)
        if not (isinstance(prompt, str) or is_token_ids(prompt) or several):
            raise ValueError(f"must be text, a list of token ids (integers), or a list of either (several prompts), "
                             f"got {prompt!r:.60}")  # fmt: skip
        if not prompt:
            raise ValueError("must not be empty")
        for text in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(text, str):
                _unicode_text(text)
        return prompt

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: each choice is its prompt, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def max_new_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo else None
        return replace(super().sampling_params(default_max_tokens), logprobs=self.logprobs,
                       prompt_logprobs=prompt_logprobs)  # fmt: skip

    @property
    def prompts(self) -> list[Prompt]:
        """Each prompt of the request: a text or a list of token ids."""
        if isinstance(self.prompt, str) or all(type(token) is int for token in self.prompt):
            return [self.prompt]
        return list(self.prompt)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str  # checked as Unicode by ChatMessage


class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for "system" (its instructions to the model).
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _unicode_text_parts(cls, content: object) -> object:
        # Before the union, whose errors would name its members.
        if isinstance(content, str):
            _unicode_text(content)
        elif isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i} is of type {kind!r}: a4 serves text models, only 'text' parts")
                if isinstance(part.get("text"), str):
                    _unicode_text(part["text"])
        return content

    def template_message(self) -> dict[str, str]:
        """The message as a chat template takes it; text parts are joined by newlines, as vLLM does."""
        text = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name for max_tokens
    logprobs: bool = False  # each output token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and the k most likely tokens' (needs logprobs)

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_max_tokens(cls, max_completion_tokens: int | None, info: ValidationInfo) -> int | None:
        if max_completion_tokens is not None and info.data.get("max_tokens") is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return max_completion_tokens

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top_logprobs

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return replace(super().sampling_params(default_max_tokens), logprobs=logprobs)


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

    @staticmethod
    def total(usages: list[UsageInfo], n: int = 1) -> UsageInfo:
        """The usage of several requests together (a completion of several prompts, `n` samples each, in order):
        each prompt counted once, as vLLM does (its samples share its prefill)."""
        return UsageInfo.of(
            sum(u.prompt_tokens for u in usages[::n]),
            sum(u.completion_tokens for u in usages),
            sum(u.prompt_tokens_details.cached_tokens for u in usages[::n]),
        )


class CompletionLogprobs(BaseModel):
    """Per token of a choice (an echoed prompt's first: logprob and top_logprobs null)."""

    text_offset: list[int]  # where the token's text starts in the choice's text
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]  # the token's own and the k most likely: text -> logprob


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: CompletionLogprobs | None = None


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


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text in UTF-8


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]  # the k most likely tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


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
    logprobs: ChatLogprobs | None = None


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


class TokenizeCompletionRequest(StrictModel):
    """POST /tokenize of a text (vLLM's body)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, prompt: str) -> str:
        return _unicode_text(prompt)


class TokenizeChatRequest(StrictModel):
    """POST /tokenize of messages, rendered by the chat template as /v1/chat/completions renders them (vLLM's
    body; its `add_special_tokens` is False: the template writes them)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
