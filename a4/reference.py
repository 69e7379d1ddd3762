"""transformers as ground truth: greedy generations and per-layer captures that a4's checks compare against.

`hf_greedy` (and `hf_greedy_with_logits`, which also returns the logits that chose each token) is the reference of
every token-by-token check; `hf_token_ranks` ranks another system's tokens under transformers' logits, for bfloat16,
where rounding makes token-by-token equality the wrong test; `hf_log_softmax` is the reference of logprobs.
`hf_prefill_capture` and `hf_decode_capture` record, for one sequence, what each decoder layer's mixer (self_attn /
linear_attn) and MLP read and wrote, the logits and the cache transformers keeps (keys after k_norm and RoPE, GDN
conv and recurrent states), for layer-level checks.

transformers swaps in flash-linear-attention and causal-conv1d kernels when they are importable, which changes the
numerics; this module refuses to run if either is installed. Attention runs with transformers' "eager"
implementation and MoE experts with "eager" experts: the plain PyTorch code in the modeling files.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from a4.dtypes import resolve_dtype
from a4.kernels import TRANSFORMERS_KERNEL_PACKAGES



class ReferenceEnvironmentError(RuntimeError):
    """A package is installed that would make transformers' reference numerics differ from its PyTorch code."""


def assert_reference_environment() -> None:
    found = [name for name in TRANSFORMERS_KERNEL_PACKAGES if importlib.util.find_spec(name) is not None]
    if found:
        raise ReferenceEnvironmentError(
            f"{', '.join(found)} importable: transformers would replace its PyTorch GDN/conv code with these kernels. "
            "Uninstall them (pip uninstall flash-linear-attention causal-conv1d) wherever the reference runs."
        )


assert_reference_environment()

# transformers warns, once per function, that it runs its PyTorch GDN code because flash-linear-attention and
# causal-conv1d are not installed, and advises installing them. Here that PyTorch code IS the reference (the kernels
# would change its numerics), so the advice is noise that contradicts the course.
logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)

def load_hf_model(model_dir: str | Path, dtype: str | torch.dtype = "float32") -> torch.nn.Module:
    """A fresh transformers model of the checkpoint's architecture, in eval mode, on CPU (not cached)."""
    import transformers

    # One bar per load is noise in test logs; loading info is checked by tests instead.
    transformers.utils.logging.disable_progress_bar()
    model_dir = Path(model_dir)
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model_classes = {
        "Qwen3ForCausalLM": transformers.Qwen3ForCausalLM,
        "Qwen3_5ForConditionalGeneration": transformers.Qwen3_5ForConditionalGeneration,
        "Qwen3_5MoeForConditionalGeneration": transformers.Qwen3_5MoeForConditionalGeneration,
    }
    if arch not in model_classes:
        raise ValueError(f"{model_dir}: architecture {arch!r} has no reference (known: {sorted(model_classes)})")
    kwargs = {"experts_implementation": "eager"} if "Moe" in arch else {}
    model = model_classes[arch].from_pretrained(
        model_dir, dtype=resolve_dtype(dtype), attn_implementation="eager", **kwargs
    )
    return model.eval()


@functools.lru_cache(maxsize=8)
def _cached_model(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    return load_hf_model(model_dir, dtype)


def cached_hf_model(model_dir: str | Path, dtype: str | torch.dtype = "float32") -> torch.nn.Module:
    """load_hf_model, memoised per (directory, dtype): tests call the reference often. Do not modify the model."""
    return _cached_model(str(Path(model_dir).resolve()), resolve_dtype(dtype))


def hf_greedy(
    model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, dtype: str | torch.dtype = "float32"
) -> list[list[int]]:
    """Greedy continuation of each prompt by transformers' `generate`, each prompt alone (no padding).

    Returns only the new tokens. Generation stops after generation_config.json's eos tokens, as `generate` does:
    a stop token, when hit, is the last element of its list.
    """
    model = cached_hf_model(model_dir, dtype)
    return [_greedy_generate(model, prompt, max_new_tokens)[0, len(prompt) :].tolist() for prompt in prompts]


def hf_greedy_with_logits(
    model_dir: str | Path, prompt: list[int], max_new_tokens: int, dtype: str | torch.dtype = "float32"
) -> tuple[list[int], torch.Tensor]:
    """`hf_greedy` of one prompt, with the logits that chose each new token: (new tokens, float32 logits [n, vocab])."""
    model = cached_hf_model(model_dir, dtype)
    generated = _greedy_generate(model, prompt, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    return generated.sequences[0, len(prompt) :].tolist(), torch.cat(generated.logits).float()


def hf_log_softmax(model_dir: str | Path, token_ids: list[int], dtype: str | torch.dtype = "float32") -> torch.Tensor:
    """transformers' log-probabilities along one sequence: log-softmax of its float32 logits, [len(token_ids), vocab];
    row i scores the token at position i + 1 (the reference of a4's logprobs and prompt logprobs)."""
    model = cached_hf_model(model_dir, dtype)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def hf_token_ranks(
    model_dir: str | Path, prompts: list[list[int]], continuations: list[list[int]], dtype: str | torch.dtype = "float32"
) -> list[list[int]]:
    """Teacher-forced ranks of another system's tokens: for each token of each continuation, how many tokens
    transformers' logits put above it at that position, given the prompt and the continuation before it (0: it is
    transformers' own greedy choice there). One forward per sequence, each alone (no padding)."""
    model = cached_hf_model(model_dir, dtype)
    ranks = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        if not continuation:
            ranks.append([])
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + continuation])).logits[0].float()
        # The logits at position i choose token i + 1: those of the prompt's last token choose the first new one.
        chosen_by = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)]
        chosen = chosen_by.gather(1, torch.tensor(continuation)[:, None])
        ranks.append((chosen_by > chosen).sum(dim=1).tolist())
    return ranks


def _greedy_generate(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, **outputs: bool) -> object:
    """transformers' greedy `generate` of one prompt alone (no padding); `outputs`: what it returns besides tokens."""
    if not prompt:
        raise ValueError("hf_greedy: empty prompt")
    input_ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            # The checkpoints' sampling defaults do not apply to greedy decoding.
            temperature=None,
            top_k=None,
            top_p=None,
            **outputs,
        )


# ---------------------------------------------------------------------------------------------------------- capture


@dataclass
class LayerCapture:
    """One decoder layer during one forward of a single sequence. T = tokens fed, H = hidden size.

    Activations are in the model dtype. For full-attention layers the GDN fields are None, and conversely.
    """

    kind: str  # "full_attention" or "linear_attention"
    layer_input: torch.Tensor  # [T, H] residual stream entering the layer
    mixer_input: torch.Tensor  # [T, H] input of self_attn / linear_attn (after input_layernorm)
    mixer_output: torch.Tensor  # [T, H] its output (after o_proj / out_proj), before the residual add
    mlp_input: torch.Tensor  # [T, H] input of the MLP (after post_attention_layernorm)
    mlp_output: torch.Tensor  # [T, H] its output (MoE: routed experts + gated shared expert), before the residual add
    layer_output: torch.Tensor  # [T, H] residual stream leaving the layer
    # MoE only: router logits [T, E] (before softmax).
    router_logits: torch.Tensor | None = None
    # Full attention, cache after the forward (S = all cached tokens): [nKV, S, head_dim], keys after k_norm and RoPE.
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None  # [nKV, S, head_dim]
    # GDN, cache after the forward: the last `kernel` pre-conv inputs (q|k|v channels), left-zero-padded when fewer
    # tokens were seen: [conv_dim, kernel] (transformers keeps kernel columns, an engine needs only kernel - 1).
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None  # [Hv, dk, dv], the GDN state S after the last token


@dataclass
class Capture:
    """One forward of one sequence through transformers, with the cache it leaves behind."""

    input_ids: list[int]  # the T tokens fed in this forward
    positions: list[int]  # their positions (prefill: 0..T-1; decode: the prompt length)
    layers: list[LayerCapture]
    final_hidden: torch.Tensor  # [T, H] after the final norm (model dtype)
    logits: torch.Tensor  # [T, V] float32 (the model-dtype logits, upcast as generate does before argmax)
    cache: object = field(repr=False)  # transformers' cache object itself, for anything not copied above


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    inner = model.model
    return inner.language_model.norm if hasattr(inner, "language_model") else inner.norm


def _layer_kinds(model: torch.nn.Module) -> list[str]:
    text_config = model.config.get_text_config()
    return list(getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers)


def _first(value: object) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


def _traced_forward(model: torch.nn.Module, input_ids: list[int], cache: object | None) -> Capture:
    """model(input_ids) continuing `cache` (None: a fresh one), recording every decoder layer with forward hooks."""
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    # int(): transformers 5.25 returns the cache's own length tensor, which the forward below advances in place.
    past = int(cache.get_seq_length())
    kinds = _layer_kinds(model)
    records: list[dict[str, torch.Tensor]] = [{} for _ in kinds]
    handles = []

    def record(store: dict[str, torch.Tensor], in_key: str | None, out_key: str):
        def hook(module, args, kwargs, output):
            if in_key is not None:
                store[in_key] = (args[0] if args else kwargs["hidden_states"])[0].detach().clone()
            store[out_key] = _first(output)[0].detach().clone()

        return hook

    def record_router(store: dict[str, torch.Tensor]):
        def hook(module, args, output):
            store["router_logits"] = output[0].detach().clone()

        return hook

    try:
        for i, layer in enumerate(_decoder_layers(model)):
            mixer = layer.self_attn if kinds[i] == "full_attention" else layer.linear_attn
            for module, part in ((layer, "layer"), (mixer, "mixer"), (layer.mlp, "mlp")):
                hook = record(records[i], f"{part}_input", f"{part}_output")
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
            if hasattr(layer.mlp, "experts"):
                # The router sees the tokens flattened: its logits are already [T, E].
                handles.append(layer.mlp.gate.register_forward_hook(record_router(records[i])))
        final: dict[str, torch.Tensor] = {}
        handles.append(_final_norm(model).register_forward_hook(record(final, None, "final_hidden"), with_kwargs=True))
        with torch.no_grad():
            ids = torch.tensor([input_ids], dtype=torch.long)
            out = model(input_ids=ids, cache=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()

    layers = []
    for i, (kind, rec) in enumerate(zip(kinds, records)):
        capture = LayerCapture(kind=kind, **rec)
        if kind == "full_attention":
            capture.keys = cache.layers[i].keys[0].detach().clone()
            capture.values = cache.layers[i].values[0].detach().clone()
        else:
            capture.conv_state = cache.get_conv_state(i)[0].detach().clone()
            capture.recurrent_state = cache.get_recurrent_state(i)[0].detach().clone()
        layers.append(capture)
    return Capture(
        input_ids=list(input_ids),
        positions=list(range(past, past + len(input_ids))),
        layers=layers,
        final_hidden=final["final_hidden"],
        logits=out.logits[0].float(),
        cache=cache,
    )


def hf_prefill_capture(model_dir: str | Path, input_ids: list[int], dtype: str | torch.dtype = "float32") -> Capture:
    """Prefill of `input_ids` (one sequence) in transformers, with every layer's inputs, outputs and cache."""
    return _traced_forward(cached_hf_model(model_dir, dtype), list(input_ids), cache=None)


def hf_decode_capture(
    model_dir: str | Path, input_ids: list[int], next_token: int | None = None, dtype: str | torch.dtype = "float32"
) -> Capture:
    """One decode step after prefilling `input_ids`: feeds `next_token` (default: the prefill's greedy token).

    The capture holds the decode step only (T = 1, position len(input_ids)); its cache covers prompt + next_token.
    """
    model = cached_hf_model(model_dir, dtype)
    prefill = _traced_forward(model, list(input_ids), cache=None)
    if next_token is None:
        next_token = int(prefill.logits[-1].argmax())
    return _traced_forward(model, [next_token], cache=prefill.cache)
