"""Benchmark: the time of one decode step as the context grows, Gated DeltaNet against full attention.

A decode step feeds one new token per request. A full-attention layer reads the K and V of every earlier token, so
its step grows with the context; a Gated DeltaNet (GDN) layer reads its fixed-size state instead, so its step should
not. Measured at Qwen3.5-0.8B's shapes (random weights, float32, one request), at contexts up to 32k tokens:

- layers: one GDN layer (`linear_attn`) and one full-attention layer (`self_attn`) of the model, the token mixers
  alone (the MLP after each is the same in both);
- whole model: Qwen3.5-0.8B (18 GDN + 6 full-attention layers) against the same checkpoint with every layer full
  attention (`layer_types` overridden: the same widths, heads, MLP, vocabulary and layer code; only the mixer of 18
  layers differs, 190M parameters of GDN mixers becoming 132M of attention mixers).

Nothing is prefilled: the KV pool is filled with random keys and values (what they are does not change the work),
and the request's next token is fed at position `context`. Each figure is the median wall time of several runs after
a warm-up run (the two models take turns; the two layers are timed one after the other at each context); a
least-squares line through each series gives its slope, in ms per 1k tokens of context.

    python -m a4 bench decode_context [--quick] [--out DIR]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from a4.bench import write_report
from a4.bench._states import LayerStates
from a4.bench._timing import median_seconds
from a4.checkpoints import make_checkpoint
from a4.core import AttentionBackend, ForwardBatch, ForwardMode
from a4.engine.forward_batch import build_forward_batch
from a4.kvcache.kv_pool import KVPool
from a4.models.config import FULL_ATTENTION, ModelConfig
from a4.models.registry import load_model

LAYER_CONTEXTS = (256, 1024, 2048, 4096, 8192, 16384, 32768)
MODEL_CONTEXTS = (256, 2048, 8192, 16384, 32768)
QUICK_CONTEXTS = (16, 64, 256)
DTYPE = torch.float32
LAYERS = ("GDN layer", "attention layer")
MODELS = ("Qwen3.5 (GDN + attention)", "every layer attention")


def random_kv_pool(
    config: ModelConfig, num_layers: int, num_tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> KVPool:
    """A KV pool of `num_layers` layers whose first `num_tokens` locations (pages of one token) hold random K and V."""
    pool = KVPool(num_layers, num_tokens, 1, config.num_key_value_heads, config.head_dim, dtype, device)
    gen = torch.Generator(device).manual_seed(seed)
    locations = torch.arange(num_tokens, device=device)
    shape = (num_tokens, config.num_key_value_heads, config.head_dim)
    for layer in range(num_layers):
        k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(2))
        pool.set_kv(layer, locations, k, v)
    return pool


def decode_batch(
    context: int, kv_pool: KVPool, state_pool: object | None = None, backend: AttentionBackend | None = None
) -> ForwardBatch:
    """One decode step of one request (slot 0) that holds `context` tokens: its next token goes to position `context`.

    The request's tokens live at KV locations 0, 1, 2, ... (so the pool needs context + 1 locations). `backend`: the
    engine's for the device (a4.engine.factories.create_backends); default: the CPU's eager one.
    """
    return build_forward_batch(
        ForwardMode.DECODE,
        input_ids=[0],
        slots=[0],
        prefix_lens=[context],
        extend_lens=[1],
        sample_indices=[0],
        req_to_token=torch.arange(kv_pool.num_locations, device=kv_pool.device)[None],
        kv_pool=kv_pool,
        state_pool=state_pool,
        attn_backend=backend,
    )


def layer_runs(
    config: ModelConfig,
    gdn: torch.nn.Module,
    attention: torch.nn.Module,
    rotary_emb,
    contexts: tuple[int, ...],
) -> Iterator[tuple[int, dict[str, Callable[[], object]]]]:
    """For each context, one decode step of a GDN layer and of a full-attention layer, as zero-argument calls.

    gdn: a `GatedDeltaNet`; attention: a `GatedAttention` whose pool layer is 0; rotary_emb: the model's
    `RotaryEmbedding`. Both layers run in the dtype and on the device of their parameters; the calls must run in
    inference mode. Their inputs are built before they are yielded, so that a call is the layer's work alone.
    """
    weight = attention.q_proj.weight
    dtype, device = weight.dtype, weight.device
    gen = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(1, config.hidden_size, generator=gen, device=device, dtype=dtype)
    # One request's GDN state (slot 0): random, as a long context would have left it.
    states = LayerStates(
        torch.randn(1, config.conv_dim, config.linear_conv_kernel_dim - 1, generator=gen, device=device, dtype=dtype),
        torch.randn(
            1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
            generator=gen, device=device,
        ).mul_(0.1),
    )  # fmt: skip
    kv_pool = random_kv_pool(config, 1, max(contexts) + 1, dtype, device)
    for context in contexts:
        fb = decode_batch(context, kv_pool, states)
        cos, sin = rotary_emb(fb.positions, dtype)
        yield context, {
            "GDN layer": lambda: gdn(hidden, fb, 0),
            "attention layer": lambda: attention(hidden, cos, sin, fb),
        }


@torch.inference_mode()
def layer_step_seconds(
    config: ModelConfig,
    gdn: torch.nn.Module,
    attention: torch.nn.Module,
    rotary_emb,
    contexts: tuple[int, ...],
    repeats: int,
) -> dict[str, list[float]]:
    """Decode-step time of a GDN layer and a full-attention layer at each context (seconds, median of `repeats`).

    The arguments are `layer_runs`'; the two layers are timed one after the other at each context.
    """
    times: dict[str, list[float]] = {name: [] for name in LAYERS}
    for _, runs in layer_runs(config, gdn, attention, rotary_emb, contexts):
        # Each layer's runs back to back rather than taking turns: the attention layer's gathers of 64+ MB (at 32k
        # tokens) would otherwise evict the GDN layer's weights from the caches before each of its runs, and its
        # figure (flat when timed alone) would carry the attention layer's context.
        for name, run in runs.items():
            times[name].append(median_seconds({name: run}, repeats)[name])
    return times


@torch.inference_mode()
def model_step_seconds(model_dirs: dict[str, Path], contexts: tuple[int, ...], repeats: int) -> dict[str, list[float]]:
    """Decode-step time (seconds) of whole models, embedding to logits, at each context, for one request.

    All the models are loaded at once and take turns at each context, so that a slow spell of the machine hits all.
    """
    device = torch.device("cpu")
    steps = {}
    for name, model_dir in model_dirs.items():
        config, model, _ = load_model(model_dir, dtype=DTYPE, device=device, progress=False)
        kv_pool = random_kv_pool(config, len(config.full_attention_layers), max(contexts) + 1, DTYPE, device)
        state_pool = None
        if config.is_hybrid:
            # Imported here: the StatePool is an exercise (notebook 05); its zeros cost the same work as any state.
            from a4.kvcache.state_pool import StatePool

            state_pool = StatePool(config, 1, DTYPE, device)
        steps[name] = (model, kv_pool, state_pool)

    times: dict[str, list[float]] = {name: [] for name in model_dirs}
    for context in contexts:
        runs = {
            name: lambda model=model, kv_pool=kv_pool, state_pool=state_pool: model(
                decode_batch(context, kv_pool, state_pool)
            )
            for name, (model, kv_pool, state_pool) in steps.items()
        }
        for name, seconds in median_seconds(runs, repeats).items():
            times[name].append(seconds)
    return times


def slope_ms_per_1k(contexts: tuple[int, ...], seconds: list[float]) -> float:
    """The least-squares slope of time against context, in milliseconds per 1,000 tokens of context."""
    return statistics.linear_regression(contexts, seconds).slope * 1e6


def series_report(contexts: tuple[int, ...], times: dict[str, list[float]]) -> dict:
    return {
        "contexts": list(contexts),
        "seconds": times,
        "slope_ms_per_1k_tokens": {name: slope_ms_per_1k(contexts, s) for name, s in times.items()},
    }


def print_table(title: str, part: dict) -> None:
    names = list(part["seconds"])
    print(f"{title}: one decode step, ms (median of the runs)")
    print(f"{'context':>8}" + "".join(f"{name:>28}" for name in names))
    for i, context in enumerate(part["contexts"]):
        print(f"{context:>8}" + "".join(f"{part['seconds'][name][i] * 1e3:>28.2f}" for name in names))
    print(f"{'slope':>8}" + "".join(f"{part['slope_ms_per_1k_tokens'][n]:>18.3f} ms / 1k" for n in names))


def draw_part(part: dict, ax, title: str) -> None:
    """One part of a report ("layers" or "model"): ms per decode step against context, one line per series."""
    for name, seconds in part["seconds"].items():
        slope = part["slope_ms_per_1k_tokens"][name]
        ax.plot(part["contexts"], [s * 1e3 for s in seconds], marker="o", label=f"{name} ({slope:+.2f} ms / 1k)")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(fontsize=8)


def draw(report: dict, axes) -> None:
    """The layer panel and the whole-model panel of a report, on two matplotlib axes."""
    draw_part(report["layers"], axes[0], "one layer (token mixer only)")
    draw_part(report["model"], axes[1], "whole model (embedding to logits)")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    draw(report, axes)
    fig.suptitle(f"decode step vs context on CPU ({report['shapes']}, {report['dtype']}, one request)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure, print the tables, write decode_context.json and .png into out_dir (when given); returns the JSON."""
    preset = "tiny" if quick else "0.8b"
    layer_contexts, model_contexts = (QUICK_CONTEXTS, QUICK_CONTEXTS) if quick else (LAYER_CONTEXTS, MODEL_CONTEXTS)
    repeats = 1 if quick else 3
    hybrid_dir = make_checkpoint(None, "qwen3_5", preset=preset)
    config, model, _ = load_model(hybrid_dir, dtype=DTYPE, device="cpu", progress=False)
    all_attention_dir = make_checkpoint(
        None, "qwen3_5", preset=preset, layer_types=[FULL_ATTENTION] * config.num_hidden_layers
    )

    decoder_layers = model.model.layers
    gdn = next(layer.linear_attn for layer in decoder_layers if layer.is_linear)
    attention = next(layer.self_attn for layer in decoder_layers if not layer.is_linear)
    layer_times = layer_step_seconds(
        config, gdn, attention, model.model.rotary_emb, layer_contexts, repeats=3 * repeats
    )
    del model, gdn, attention, decoder_layers

    model_times = model_step_seconds(
        {MODELS[0]: hybrid_dir, MODELS[1]: all_attention_dir}, model_contexts, repeats
    )
    gdn_layers = len(config.linear_attention_layers)
    report = {
        "benchmark": "decode_context",
        "shapes": f"Qwen3.5-{preset}",
        "models": {
            MODELS[0]: f"{gdn_layers} GDN + {config.num_hidden_layers - gdn_layers} full-attention layers",
            MODELS[1]: f"{config.num_hidden_layers} full-attention layers, same widths",
        },
        "dtype": str(DTYPE).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "repeats": {"layers": 3 * repeats, "model": repeats},
        "statistic": "median wall time after one warm-up run",
        "layers": series_report(layer_contexts, layer_times),
        "model": series_report(model_contexts, model_times),
    }
    # From the second context to the last (1k to 32k tokens in the full run): how flat the GDN layer's step is.
    gdn_times = layer_times["GDN layer"]
    report["gdn_layer_change"] = {
        "from": layer_contexts[1], "to": layer_contexts[-1], "ratio_minus_1": gdn_times[-1] / gdn_times[1] - 1
    }
    print_table(f"one layer, Qwen3.5-{preset} shapes, {report['dtype']}", report["layers"])
    print_table("whole model", report["model"])
    change = report["gdn_layer_change"]
    print(f"GDN layer step from {change['from']} to {change['to']} tokens of context: {change['ratio_minus_1']:+.1%}")
    if out_dir is not None:
        write_report(out_dir, "decode_context", report, plot)
    return report
