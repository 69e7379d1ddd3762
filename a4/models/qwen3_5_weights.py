# GENERATED from solutions/a4/models/qwen3_5_weights.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/models/qwen3_5_weights.py instead
# and run `python -m a4.course sync`.
"""Exercise (notebook 02): load only the language model out of a multimodal Qwen3.5 checkpoint.

A Qwen3.5 checkpoint is a `Qwen3_5ForConditionalGeneration`: besides the language model it stores a vision encoder
and a multi-token-prediction (MTP) module that a4 never runs. Its keys fall into four groups:

    model.language_model.*   the language model: embeddings, decoder layers, final norm
    lm_head.weight           the output projection, only when the embeddings are NOT tied (tied checkpoints reuse
                             model.language_model.embed_tokens.weight and do not store it)
    model.visual.*           the vision encoder
    mtp.*                    the MTP module (one extra decoder layer for speculative decoding)

a4's `Qwen3_5ForConditionalGeneration` holds the language model alone, under the names a text-only checkpoint
would use, the same as a4's Qwen3: `model.embed_tokens.weight`, `model.layers.<i>.<...>`, `model.norm.weight`,
`lm_head.weight`. When the embeddings are tied, lm_head.weight and model.embed_tokens.weight are one tensor, and the
model ties them itself.

`a4.models.weights.load_weights` calls `checkpoint_key_map` on every key of the checkpoint, before reading any
tensor. A key mapped to None is skipped and never read from disk. Every other key must name a parameter of the
model with the checkpoint tensor's shape, and every parameter must be filled exactly once. Otherwise the loader
raises ONE WeightLoadError that lists every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations


def checkpoint_key_map(key: str) -> str | None:
    """a4's parameter name for the checkpoint key `key`, or None for a tensor a4 does not use.

    - `model.language_model.<rest>` -> `model.<rest>`, for example
      `model.language_model.layers.0.linear_attn.A_log` -> `model.layers.0.linear_attn.A_log`.
    - `lm_head.weight` -> `lm_head.weight` (it is already a4's name).
    - `model.visual.<rest>` and `mtp.<rest>` -> None: skipped, never read.
    - any other key -> the key itself, unchanged. Never None: a key outside the four groups means the file is not
      what a4 thinks it is, and the loader must report it as unexpected rather than drop it without a word.
      (Every parameter would still be filled, so nothing else would flag a tensor the file meant the model to use.)
    """
    raise NotImplementedError("Exercise weights-key-map: checkpoint keys onto a4's names; skip vision and MTP, keep unknowns (notebooks/02_weights.ipynb)")
