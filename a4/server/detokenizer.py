"""Incremental detokenization: one request's output text, released as its tokens arrive, never a broken character.

A byte-level tokenizer can split one character over several tokens (an emoji is four UTF-8 bytes; a token may hold
one of them). `tokenizers`' DecodeStream keeps the tokens whose text is not complete yet and releases their text once
it is (vLLM's and SGLang's detokenizers hold back text that ends in U+FFFD the same way). On top of that, stop
strings: text that could be the start of a stop string is held back until the next tokens tell, and a stop string
found ends the text just before it. Released pieces put together are always a prefix of the text of all the tokens,
and at the end they are all of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        """`tokenizer`: the `tokenizers` backend (a transformers fast tokenizer's `backend_tokenizer`)."""
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._text = ""  # decoded so far (complete characters only), cut at a stop string
        self._released = 0  # characters of _text handed out
        self.stopped = False  # a stop string was found: the text is final

    @property
    def num_tokens(self) -> int:
        """Tokens that made the text: all of them, or those up to the one that completed a stop string."""
        return len(self._token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; return the text they make final (possibly ""). After a stop string, tokens are ignored."""
        for token_id in token_ids:
            if self.stopped:
                break
            self._token_ids.append(token_id)
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self._text += piece
                self._cut_at_stop()
        held = 0 if self.stopped else self._partial_stop_len()
        return self._release(len(self._text) - held)

    def finish(self) -> str:
        """The text not handed out yet, once the request has finished: what was held back for a stop string that
        never came, and the bytes of an incomplete last character (as `decode` shows them, U+FFFD)."""
        if not self.stopped:
            full = self._tokenizer.decode(self._token_ids, skip_special_tokens=True)
            if full.startswith(self._text):
                self._text = full
        return self._release(len(self._text))

    def _cut_at_stop(self) -> None:
        # Released text never holds the start of a stop string (that is held back), so the search starts after it.
        found = [i for stop in self._stop if (i := self._text.find(stop, self._released)) >= 0]
        if found:
            self._text = self._text[: min(found)]
            self.stopped = True

    def _partial_stop_len(self) -> int:
        """The longest end of the unreleased text that some stop string starts with."""
        pending = self._text[self._released :]
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, end: int) -> str:
        piece = self._text[self._released : end]
        self._released = max(self._released, end)
        return piece
