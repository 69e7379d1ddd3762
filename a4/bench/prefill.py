"""Benchmark: the whole model's prefill with the chunked gated delta rule against the token-by-token recurrence.

The Gated DeltaNet layers run a prompt in the chunked form (`chunk_gated_delta_rule`: the corrections of a chunk
folded into matrix products, only the state passed from chunk to chunk), and run the recurrence only to decode. Here
the same prompt goes through a4's engine twice, once as it is and once with the recurrence in prefill too, at
Qwen3.5-0.8B's shapes (random weights, float32, one prompt of 512 and of 2048 tokens, one new token). The two forms
take turns; each figure is the median wall time of the runs after a warm-up run, as prompt tokens/s.

The GDN layer has no switch between the two forms: it calls the module's `chunk_gated_delta_rule` for every prefill.
`recurrence_in_prefill()` replaces that module attribute, for the duration of a `with` block, by
`recurrent_prefill`, which has the same signature and runs `recurrent_gated_delta_rule` over each sequence. Nothing
outside this benchmark changes.

    python -m a4 bench prefill [--quick] [--out DIR]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from a4.bench import write_report
from a4.bench._states import LayerStates
from a4.bench._timing import median_seconds
from a4.checkpoints import make_checkpoint
from a4.core import ForwardMode, SamplingParams
from a4.engine.forward_batch import build_forward_batch

FORMS = ("chunked", "recurrence")
LENGTHS = (512, 2048)
QUICK_LENGTHS = (32, 128)


def recurrent_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule`'s arguments and results, computed by the recurrence, one sequence after another."""
    from a4.layers.deltanet import recurrent_gated_delta_rule

    bounds = cu_seqlens.tolist()
    outputs, states = [], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        sequence = (x[None, start:end] for x in (q, k, v, g, beta))  # [1, L, ...]: a batch of one
        o, state = recurrent_gated_delta_rule(*sequence, initial_state[i : i + 1])
        outputs.append(o[0])
        states.append(state)
    return torch.cat(outputs), torch.cat(states)


@contextmanager
def recurrence_in_prefill() -> Iterator[None]:
    """Within the block, every GDN layer runs its prefill with the recurrence (see the module docstring)."""
    # The name the eager GDN backend calls notebook 04's chunked rule by (a4/layers/gdn_backend.py).
    import a4.layers.gdn_backend as backend

    chunked = backend.chunk_gated_delta_rule
    backend.chunk_gated_delta_rule = recurrent_prefill
    try:
        yield
    finally:
        backend.chunk_gated_delta_rule = chunked


def prefill_seconds(llm, prompt: list[int], repeats: int) -> dict[str, float]:
    """Median wall time of `llm` prefilling `prompt` (and sampling one token) in each GDN form, runs taking turns."""

    def chunked() -> None:
        llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))

    def recurrence() -> None:
        with recurrence_in_prefill():
            chunked()

    return median_seconds({"chunked": chunked, "recurrence": recurrence}, repeats)


@torch.inference_mode()
def layer_prefill_seconds(gdn: torch.nn.Module, lengths: tuple[int, ...], repeats: int) -> dict[str, list[float]]:
    """One GDN layer's prefill of one sequence of each length from a zero state, in both forms; seconds (median of
    `repeats`, the forms taking turns). gdn: a `GatedDeltaNet`, run in the dtype of its parameters."""
    projection = gdn.in_proj_qkv
    dtype, device = projection.weight.dtype, projection.weight.device
    states = LayerStates(
        torch.zeros(1, projection.out_features, gdn.conv_kernel - 1, dtype=dtype, device=device),
        torch.zeros(1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, device=device),
    )
    gen = torch.Generator(device).manual_seed(0)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for length in lengths:
        hidden = torch.randn(length, projection.in_features, generator=gen, dtype=dtype, device=device)
        fb = build_forward_batch(
            ForwardMode.EXTEND,
            input_ids=[0] * length,
            slots=[0],
            prefix_lens=[0],
            extend_lens=[length],
            sample_indices=[length - 1],
            req_to_token=torch.arange(length, device=device)[None],
            kv_pool=None,  # a GDN layer keeps no KV
            state_pool=states,
        )

        def chunked() -> None:
            states.conv.zero_(), states.recurrent.zero_()  # from a zero state, as a new request
            gdn(hidden, fb, 0)

        def recurrence() -> None:
            with recurrence_in_prefill():
                chunked()

        for form, seconds in median_seconds({"chunked": chunked, "recurrence": recurrence}, repeats).items():
            times[form].append(seconds)
    return times


def print_table(report: dict) -> None:
    print(
        f"whole-model prefill, {report['shapes']}, {report['dtype']}, {report['threads']} CPU threads: prompt "
        "tokens/s (median of the runs)"
    )
    print(f"{'tokens':>7}" + "".join(f"{form:>14}" for form in FORMS) + f"{'chunked / recurrence':>22}")
    for row in report["results"]:
        rates = row["tokens_per_s"]
        print(f"{row['T']:>7}" + "".join(f"{rates[f]:>14.1f}" for f in FORMS) + f"{row['speedup']:>21.2f}x")


def draw(report: dict, ax) -> None:
    """Prompt tokens/s of each form at each prompt length, as grouped bars on one matplotlib axis."""
    lengths = [row["T"] for row in report["results"]]
    width = 0.4
    for offset, form in ((-width / 2, "chunked"), (width / 2, "recurrence")):
        rates = [row["tokens_per_s"][form] for row in report["results"]]
        bars = ax.bar([i + offset for i in range(len(lengths))], rates, width, label=f"GDN {form}")
        if form == "chunked":
            ax.bar_label(bars, [f"{row['speedup']:.2f}x" for row in report["results"]], fontsize=8)
    ax.set_xticks(range(len(lengths)), [f"{t} tokens" for t in lengths])
    ax.set_ylabel("prompt tokens/s")
    ax.set_title(f"whole-model prefill, {report['shapes']} (labels: chunked / recurrence)", loc="left", fontsize=10)
    ax.legend(fontsize=8)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    draw(report, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure, print the table, write prefill.json and prefill.png into out_dir (when given); returns the JSON."""
    from a4 import LLM

    preset, lengths = ("tiny", QUICK_LENGTHS) if quick else ("0.8b", LENGTHS)
    model_dir = make_checkpoint(None, "qwen3_5", preset=preset)
    # No prefix cache: the runs repeat one prompt, which must be prefilled every time.
    llm = LLM(
        model_dir, dtype="float32", max_running_requests=1, max_prefill_tokens=max(lengths), enable_prefix_cache=False
    )
    config = llm.engine.model_config
    gen = torch.Generator().manual_seed(0)
    # The recurrence takes minutes at 2048 tokens on CPU: fewer runs of the longer prompt.
    repeats = {length: 1 if quick or length > 512 else 3 for length in lengths}
    results = []
    for length in lengths:
        prompt = torch.randint(0, config.vocab_size, (length,), generator=gen).tolist()
        seconds = prefill_seconds(llm, prompt, repeats[length])
        rates = {form: length / s for form, s in seconds.items()}
        results.append(
            {"T": length, "seconds": seconds, "tokens_per_s": rates, "speedup": rates["chunked"] / rates["recurrence"]}
        )
    report = {
        "benchmark": "prefill",
        "shapes": f"Qwen3.5-{preset}",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "repeats": {str(length): n for length, n in repeats.items()},
        "statistic": "median wall time after one warm-up run",
        "results": results,
    }
    print_table(report)
    if out_dir is not None:
        write_report(out_dir, "prefill", report, plot)
    return report
