"""a4: a small SGLang-style inference engine that learns to serve the hybrid model Qwen3.5.

    from a4 import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outputs = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))

Where things live: `core.py` (Req, Batch, ForwardBatch), `models/` (configs, weights, the model files),
`layers/` (attention, Gated DeltaNet, norms, RoPE), `kvcache/` (the KV pool, the state pool, the radix cache),
`scheduler/` (request slots, continuous batching, chunked prefill), `engine/` (memory plan, model runner),
`llm.py` (the offline API), `checkpoints.py` (tiny checkpoints, no hub), `reference.py` (transformers as the
ground truth), `course/` (notebook tooling).
"""

from a4._overlay import overlay

overlay(__name__, __path__)

__all__ = ["LLM", "SamplingParams", "Output"]


def __getattr__(name: str):
    # Imported lazily so that `python -m a4.course ...` and the config exercise load without the whole engine.
    if name == "LLM":
        from a4.llm import LLM

        return LLM
    if name in ("SamplingParams", "Output"):
        from a4 import core

        return getattr(core, name)
    raise AttributeError(f"module 'a4' has no attribute {name!r}")
