"""Log-probabilities in OpenAI's shapes, as vLLM writes them.

The engine gives each position its token's log-probability and the k most likely tokens' (a4.core.TokenLogprobs).
A completion (`logprobs: k`) lists per token its text, its logprob, a dict of the top tokens' texts and logprobs
(its own first, then the k most likely: up to k + 1 entries, as OpenAI defines it) and its character offset in the
choice's text; an echoed prompt's first token has no logprob (null, as in vLLM). A chat (`logprobs: true,
top_logprobs: k`) lists per token its text, logprob and UTF-8 bytes, with the k most likely tokens likewise. A token's
text is its own decoding, which for a byte-level tokenizer can be part of a character (then U+FFFD, as in vLLM);
-inf (a token the model rules out) is written as -9999.0, the JSON-safe value OpenAI uses.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from a4.core import TokenLogprobs
from a4.server.protocol import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

# Each position: its token id, and its log-probabilities (None for a prompt's first token, which nothing scores).
Scored = Sequence[tuple[int, TokenLogprobs | None]]
LOWEST_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


class LogprobsFormatter:
    def __init__(self, tokenizer: Tokenizer, top: int) -> None:
        """`tokenizer`: the `tokenizers` backend; `top`: how many of the most likely tokens each position lists."""
        self._tokenizer, self.top = tokenizer, top
        self._texts: dict[int, str] = {}  # a request's tokens repeat (top lists, echoed prompts)

    def token_text(self, token_id: int) -> str:
        if (text := self._texts.get(token_id)) is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion(self, scored: Scored, text_offset: int = 0) -> CompletionLogprobs:
        """The completion shape of `scored`, whose first token starts at character `text_offset` of the choice."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in scored:
            token = self.token_text(token_id)
            offsets.append(text_offset)
            text_offset += len(token)
            tokens.append(token)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(entry.logprob))
            top = {token: _finite(entry.logprob)}
            for top_id, logprob in entry.top[: self.top]:
                top.setdefault(self.token_text(top_id), _finite(logprob))
            top_logprobs.append(top)
        return CompletionLogprobs(
            text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs
        )

    def chat(self, scored: Scored) -> ChatLogprobs:
        content = []
        for token_id, entry in scored:
            top = [self._chat_top(top_id, logprob) for top_id, logprob in entry.top[: self.top]]
            content.append(ChatTokenLogprob(**self._chat_top(token_id, entry.logprob).model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chat_top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        token = self.token_text(token_id)
        return ChatTopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8", "replace")))
