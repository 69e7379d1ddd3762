"""Prompts as token ids: a completion's texts, and a chat's messages rendered by the checkpoint's chat template, with
the role markers coming only from the template.

A message's content is text, never markup: `<|im_end|>\n<|im_start|>system\n...` written by a user is encoded as
those characters, not as the special tokens, so that nobody can forge a turn of another role (transformers'
`apply_chat_template` and `encode` would make them special tokens; vLLM no longer does). A content without
special-token text is encoded exactly as before (the template's text, tokenized whole). One with some is rendered
with a placeholder in its place, and the rendered text is encoded piece by piece: the template's own special tokens
as themselves, the text between them, contents included, with special-token text as plain text. Special tokens cut
the encoding in the same places either way, so everything else gets the same ids. A server started with
`--enable-special-tokens-in-messages` keeps transformers' behaviour. A completion's prompt is raw text: its
special-token text is the caller's markup (as in vLLM and SGLang).

Encoding runs in a worker thread (the routes call it through `run_in_threadpool`): `tokenizers` releases the GIL while
it encodes, so a long prompt does not hold up the event loop, other streams or /health.
"""

from __future__ import annotations

import re
import uuid

from tokenizers import Tokenizer


class PromptEncoder:
    def __init__(self, tokenizer, enable_special_tokens_in_messages: bool = False) -> None:
        """`tokenizer`: the model's transformers tokenizer, with its chat template."""
        self.tokenizer = tokenizer
        self.enable_special_tokens_in_messages = enable_special_tokens_in_messages
        self._special_ids = {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        longest_first = sorted(self._special_ids, key=len, reverse=True)
        # Capturing: `split` keeps the special tokens found.
        self._special_text = re.compile(f"({'|'.join(map(re.escape, longest_first))})") if longest_first else None
        # A copy that reads special-token text as plain text; set once, so that threads can share it.
        self._plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._plain.encode_special_tokens = True

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.chat_template is not None

    def text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The ids of `messages` ({"role", "content"}) rendered with the generation prompt (unless told not to);
        ValueError if a content holds special-token text and the template does not render contents as they are (then
        they cannot be told from its own text)."""
        text = self._render(messages, add_generation_prompt)
        if self.enable_special_tokens_in_messages or not any(self._has_special_text(m["content"]) for m in messages):
            # The template writes the special tokens itself.
            return self.tokenizer.encode(text, add_special_tokens=False)
        marker = f"\ue000{uuid.uuid4().hex}:"
        template = self._render([{**m, "content": f"{marker}{i}\ue000"} for i, m in enumerate(messages)],
                                add_generation_prompt)
        ids, plain, rendered = [], [], []
        for i, piece in enumerate(re.split(f"{re.escape(marker)}(\\d+)\ue000", template)):
            if i % 2:  # a placeholder's index: the content goes in as text
                plain.append(messages[int(piece)]["content"])
                continue
            for j, part in enumerate(self._split_special(piece)):
                if j % 2:  # the template's special token
                    ids += self._encode_plain("".join(plain)) + [self._special_ids[part]]
                    rendered += [*plain, part]
                    plain = []
                else:
                    plain.append(part)
        ids += self._encode_plain("".join(plain))
        if "".join(rendered + plain) != text:
            raise ValueError(
                "a message holds special-token text, and this model's chat template changes message contents as it "
                "renders them, so it cannot be kept apart from the template's own: remove it from the message"
            )
        return ids

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _has_special_text(self, content: str) -> bool:
        return self._special_text is not None and self._special_text.search(content) is not None

    def _split_special(self, text: str) -> list[str]:
        """text, then each special token found in it and the text after it, alternately."""
        return [text] if self._special_text is None else self._special_text.split(text)

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []
