"""A tiny Qwen3.5 that speaks text, for the server's tests: the random tiny checkpoint plus a byte-level BPE tokenizer
trained here on a few sentences, with Qwen's special tokens and chat template (ChatML: `<|im_start|>` / `<|im_end|>`).

The tiny checkpoint's vocabulary (1024) keeps Qwen's special tokens at its end: 1000 `<|endoftext|>` (eos),
1001 `<|im_start|>`, 1002 `<|im_end|>` (eos in generation_config.json), as 151643..151645 in the real one. The
tokenizer puts them there and trains its ordinary tokens below 1000 (ids the few sentences leave unused decode to
nothing, on both sides of every comparison). The model is random, so its text is random bytes: many of its
characters are split across tokens, which is what the server's incremental detokenizer must get right.

Once the trained tiny checkpoint exists, `chat_model_dir` in tests/conftest.py returns it instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from a4.checkpoints import tiny_checkpoint

SPECIAL_TOKENS = {"<|endoftext|>": 1000, "<|im_start|>": 1001, "<|im_end|>": 1002}
# Qwen's template without tools and thinking: what the server's chat endpoint renders.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Gated DeltaNet keeps a fixed-size state per request instead of a growing KV history.",
    "Three of every four layers are linear attention; the fourth is gated full attention.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Straße, Übung, naïve café, señor, smørrebrød.",
    "深度学习模型在推理时需要缓存。",
    "The prefix cache reuses the KV of a shared system prompt. 🙂 🚀",
    "Continuous batching lets requests from different clients share decode steps.",
]


def write_chat_checkpoint(directory: str | Path) -> Path:
    """Copy the tiny Qwen3.5 checkpoint into `directory` (created) and write its tokenizer files there."""
    directory = Path(directory)
    shutil.copytree(tiny_checkpoint("qwen3_5"), directory)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=min(SPECIAL_TOKENS.values()), initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(SENTENCES, trainer)
    # Special tokens are appended after the trained vocabulary: pad it with unused ids up to where Qwen keeps them.
    filler = [f"<|unused_{i}|>" for i in range(tokenizer.get_vocab_size(), min(SPECIAL_TOKENS.values()))]
    tokenizer.add_special_tokens(filler + list(SPECIAL_TOKENS))
    assert all(tokenizer.token_to_id(token) == i for token, i in SPECIAL_TOKENS.items())
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
