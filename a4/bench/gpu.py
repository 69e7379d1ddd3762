"""Benchmark: a4 on one NVIDIA GPU against transformers, bfloat16 at Qwen3.5-0.8B's shapes, and the floor of each time.

Runs only where CUDA is present. Each part runs in a process of its own (`python -m a4 bench gpu --system PART`,
which writes PART.json into a scratch folder), one after the other, so that no system inherits another's memory,
compiled kernels or imported modules:
- floor: the GPU's memory bandwidth (a 1 GiB device-to-device copy, bytes read plus written per second) and its dense
  bf16 matrix-multiply rate (one 8192^3 GEMM), with the model's bytes (`a4.bench._floor.ModelBytes`);
- a4: the engine with CUDA graphs for decode (`cuda_graphs=True`) and overlap scheduling (the CUDA default);
  a4_no_graphs: the same with `cuda_graphs=False`; a4_no_overlap: with graphs, `overlap_schedule=False` (each step
  booked before the next is scheduled);
- transformers: `generate` with its torch Gated DeltaNet (flash-linear-attention cannot be imported in its process);
- transformers_fla: the same with flash-linear-attention, where it is installed (transformers picks it up by itself);
- context: one GDN layer, one full-attention layer and the whole model decoding one token, at contexts of 1k to 128k,
  each as the engine's decode step runs it (graph-safe: the GDN state updated by slot, attention through the engine's
  backend);
- throughput: offline throughput in nano-vllm's benchmark shape (256 requests queued at once, prompt and output
  lengths uniform in [100, 1024], seed 0, `ignore_eos`, room for every request), input and output tokens per second;
- spec: `bench spec`'s oracle part with decode and verify captured: k = 3 oracle drafts per step taken from a plain
  run's own greedy tokens at the same batch (all right) or made wrong (none right), decode tokens per second against
  plain decode at batch 1 and 8, timed as `bench spec` times them (random weights draft nothing useful, so
  acceptance is forced), with the acceptance measured;
- moe: Qwen3.5-35B-A3B's shapes (`qwen3_5_moe-35b-a3b`, ~70 GB in bf16) through the engine with CUDA graphs, its
  random weights built on the GPU from config.json (`load_format="dummy"`: no checkpoint on disk, which the H200's
  64 GiB would not hold), prefill and decode timed and profiled as a4's (batch 1, 8, 32);
- moe_spec: speculative decoding at those shapes, batch 1, CUDA graphs: plain decode, then k = 1, 2, 3 drafts per
  step from an oracle (a plain run's own greedy tokens: all right, or made wrong: none right) and from the model's
  own MTP module (its MoE layer; random weights: its drafts are nonsense, their cost is the figure), tokens per
  second as the spec part times them. One engine at a time, each released before the next is built: each draws the
  whole model, and two do not fit one H200.

Each system prefills one 512- and one 2,048-token prompt (median of 5 after a warm-up, one new token) and decodes at
batch 1, 8, 32, 64 and 128 (prompts of 128 tokens, median of 40 steps; a step is timed as in `bench engine`). The
two a4 systems also profile each of these steps once (torch.profiler): the GPU kernels it runs and their summed time,
against the step's wall time (the median step above; the profiler's own overhead would inflate a profiled one) and
its floor; the wall time the kernels leave is the host's (Python, the scheduler, launches) and the gaps between them.
The context part prefills nothing: the KV pool holds random keys and values (as in `bench decode-context`). Each of
its calls is captured in a CUDA graph where it can be (the figure is then the GPU's time, not Python's) and runs
eagerly where it cannot; it is timed with CUDA events over 10 calls back to back.

The floor of each time: decode, the bytes a step moves (the weights, each request's GDN state read and written back,
and the KV of its context, taken as the mean over the timed steps; of a mixture of experts' routed experts only
those the batch's tokens choose, `ModelBytes.decode_bytes`) at the copy bandwidth; prefill, its weight GEMMs (2 x
non-embedding parameters x tokens) at the GEMM rate, or the weights it reads at the copy bandwidth where that takes
longer (a mixture of experts' prompt reads nearly every routed expert). The table gives the times, a4's speedup over
each other system and the floor as a fraction of each time. Written to --out (default solutions/report/):
<gpu>_gpu.json (the schema notebook 10 reads) and <gpu>_gpu.png, <gpu> from the device's name (h200); `--quick`
(tiny shapes, a few steps) writes <gpu>_gpu_quick.*. `--parts-dir DIR` keeps each part's JSON in DIR and reuses
those already there, so that a run longer than one lease of a GPU can go on in the next. The report's meta names the
commit measured: HEAD, marked "+changes" when tracked files differ from it, or `--commit HASH` where the tree's .git
is not its own history (a copy of the tree sent to a lent GPU, whose .git may be older than the code).

    python -m a4 bench gpu [--quick] [--out DIR] [--parts-dir DIR] [--commit HASH]
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from a4._overlay import REPO_ROOT
from a4.bench import Unavailable, write_report
from a4.bench._floor import ModelBytes, copy_bytes_per_second, gemm_flop_per_second
from a4.bench._timing import device_seconds
from a4.checkpoints import make_checkpoint
from a4.core import ForwardMode
from a4.kernels import TRANSFORMERS_KERNEL_PACKAGES

DEFAULT_OUT_DIR = REPO_ROOT / "solutions" / "report"
DTYPE_NAME = "bfloat16"
DTYPE = getattr(torch, DTYPE_NAME)
# The throughput part's engines: the default one first (its figures are the part's), then the others by name.
THROUGHPUT_VARIANTS = {"default": {}, "no_overlap": {"overlap_schedule": False}, "mixed": {"enable_mixed_chunk": True}}
THROUGHPUT_COUNTERS = ("prefill_steps", "decode_steps", "mixed_steps", "prefill_seconds", "decode_seconds")
# The a4 systems and their engine options.
A4_SYSTEMS = {
    "a4": {"cuda_graphs": True},
    "a4_no_graphs": {"cuda_graphs": False},
    "a4_no_overlap": {"cuda_graphs": True, "overlap_schedule": False},
}
SYSTEMS = (*A4_SYSTEMS, "transformers", "transformers_fla")
PARTS = ("floor", *SYSTEMS, "context", "throughput", "spec", "moe", "moe_spec")
MOE_PARTS = ("moe", "moe_spec")  # the parts that draw Qwen3.5-MoE's weights themselves
FLA_DISTRIBUTIONS = ("flash-linear-attention", "fla-core")
MAX_PREFILL_TOKENS = 8192
SPEC_MEMORY_BUDGET = 16 << 30  # bytes of pools for each engine of the spec part on a GPU


@dataclass(frozen=True)
class Workload:
    preset: str  # the checkpoint's shapes
    prefill_lens: tuple[int, ...]
    batches: tuple[int, ...]  # decode batch sizes
    prompt_len: int  # of each decoding request
    decode_steps: int  # timed per batch size
    prefill_repeats: int
    contexts: tuple[int, ...]  # of the decode-vs-context part
    repeats: int  # of the floor's and the context part's timings
    copy_bytes: int
    gemm_size: int  # the floor's GEMM is gemm_size^3
    # The throughput part: nano-vllm's benchmark shape, prompt and output lengths uniform in throughput_lens.
    throughput_requests: int = 256
    throughput_lens: tuple[int, int] = (100, 1024)
    # The spec part: batch sizes, drafts per step, new tokens per request (prompts of prompt_len).
    spec_batches: tuple[int, ...] = (1, 8)
    spec_tokens: int = 3
    spec_new_tokens: int = 64
    spec_repeats: int = 2  # timed runs per system, after an untimed one
    # The moe part: the Qwen3.5-MoE preset and its decode batch sizes (prefill_lens as the other systems).
    moe_preset: str = "35b-a3b"
    moe_batches: tuple[int, ...] = (1, 8, 32)
    # The moe_spec part: drafts per step, one engine each (new tokens and repeats: the spec part's).
    moe_spec_tokens: tuple[int, ...] = (1, 2, 3)

    @staticmethod
    def full() -> Workload:
        return Workload(
            "0.8b", (512, 2048), (1, 8, 32, 64, 128), prompt_len=128, decode_steps=40, prefill_repeats=5,
            contexts=(1024, 4096, 16384, 65536, 131072), repeats=20, copy_bytes=1 << 30, gemm_size=8192,
        )  # fmt: skip

    @staticmethod
    def quick() -> Workload:
        return Workload(
            "tiny", (32, 128), (1, 8), prompt_len=16, decode_steps=4, prefill_repeats=2, contexts=(256, 1024),
            repeats=3, copy_bytes=16 << 20, gemm_size=256, throughput_requests=8, throughput_lens=(8, 32),
            spec_batches=(1, 2), spec_tokens=2, spec_new_tokens=6, spec_repeats=1, moe_preset="tiny",
            moe_batches=(1, 2), moe_spec_tokens=(1, 2),
        )  # fmt: skip

    @property
    def decode_context(self) -> float:
        """A decoding request's mean context over the timed steps."""
        return self.prompt_len + self.decode_steps / 2


# ------------------------------------------------------------------------------------- one part, in its own process


def run_part(part: str, model_dir: Path | None, workload: Workload, device: torch.device) -> dict:
    """Measure one part (see the module docstring) on `device`; the CPU runs them too, for the tests. `model_dir`:
    the checkpoint of Qwen3.5 at workload.preset (unused by the MOE_PARTS)."""
    if part == "floor":
        return measure_floor(model_dir, workload, device)
    if part == "context":
        return measure_context(model_dir, workload, device)
    if part == "throughput":
        return measure_throughput(model_dir, workload, device)
    if part == "spec":
        return measure_spec(model_dir, workload, device)
    if part == "moe":
        return measure_moe(workload, device)
    if part == "moe_spec":
        return measure_moe_spec(workload, device)
    if part in SYSTEMS:
        return measure_system(part, model_dir, workload, device)
    raise ValueError(f"unknown part {part!r} (expected one of {', '.join(PARTS)})")


def measure_floor(model_dir: Path, workload: Workload, device: torch.device) -> dict:
    from a4.models.registry import load_model

    config, model, _ = load_model(model_dir, dtype=DTYPE, device=device, progress=False)
    model_bytes = ModelBytes.of(model, config, DTYPE)
    del model
    n = workload.gemm_size
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hbm_bytes_per_s": copy_bytes_per_second(workload.copy_bytes, device, workload.repeats),
        "bf16_flop_per_s": gemm_flop_per_second(n, n, n, DTYPE, device, workload.repeats),
        **asdict(model_bytes),
    }


def measure_system(name: str, model_dir: Path, workload: Workload, device: torch.device) -> dict:
    """Prefill and decode times (ms) of one system; the a4 systems on CUDA add their launch profile."""
    from a4.models.config import load_model_config

    runner = make_runner(name, model_dir, workload, device)
    profile = name in A4_SYSTEMS and device.type == "cuda"
    return time_runner(runner, load_model_config(model_dir), workload, workload.batches, device, profile)


def time_runner(
    runner, config, workload: Workload, batches: tuple[int, ...], device: torch.device, profile: bool
) -> dict:
    """Prefill (workload.prefill_lens) and decode (`batches`) times (ms) of a runner; with `profile`, the launch
    profile of each of those steps (`step_profiles`)."""
    from a4.bench.engine import random_prompts

    lengths = (*workload.prefill_lens, *[workload.prompt_len] * max(batches))
    prompts = random_prompts(lengths, config.vocab_size, config.eos_token_ids, seed=0)
    prefill_prompts, decode_prompts = prompts[: len(workload.prefill_lens)], prompts[len(workload.prefill_lens) :]

    result = {
        "prefill_ms": {
            str(len(prompt)): device_seconds(lambda p=prompt: runner.prefill(p), device, workload.prefill_repeats) * 1e3
            for prompt in prefill_prompts
        }
    }
    runner.decode_step_seconds(decode_prompts[:1], 3)  # warm-up
    result["decode_ms"] = {
        str(batch): statistics.median(runner.decode_step_seconds(decode_prompts[:batch], workload.decode_steps + 1))
        * 1e3
        for batch in batches
    }
    if profile:
        result["launch_profile"] = step_profiles(runner.llm.engine, prefill_prompts, decode_prompts, batches, result)
    return result


@torch.inference_mode()
def measure_throughput(model_dir: Path, workload: Workload, device: torch.device) -> dict:
    """Offline throughput as nano-vllm's benchmark measures it: every request queued at once (`ignore_eos`, lengths
    drawn with seed 0), the engine with CUDA graphs and room for all of them, timed from the first to the last token."""
    import random

    from a4 import LLM, SamplingParams
    from a4.bench.engine import random_prompts
    from a4.models.config import load_model_config

    draw = random.Random(0)
    n, (low, high) = workload.throughput_requests, workload.throughput_lens
    input_lens = [draw.randint(low, high) for _ in range(n)]
    output_lens = [draw.randint(low, high) for _ in range(n)]
    config = load_model_config(model_dir)
    prompts = random_prompts(input_lens, config.vocab_size, config.eos_token_ids, seed=0)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in output_lens]
    results = {}
    # The engine as it runs by default, then without overlap scheduling and with mixed steps: one engine at a time
    # (each takes the device's free memory for its pools).
    for variant, options in THROUGHPUT_VARIANTS.items():
        llm = LLM(model_dir, dtype=DTYPE_NAME, device=device, max_running_requests=n,
                  max_prefill_tokens=MAX_PREFILL_TOKENS, enable_prefix_cache=False, cuda_graphs=True, **options)  # fmt: skip
        llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        before = replace(llm.stats)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        output_tokens = sum(len(output.token_ids) for output in outputs)
        results[variant] = {
            "requests": n,
            "input_tokens": sum(input_lens),
            "output_tokens": output_tokens,
            "seconds": seconds,
            "input_tok_per_s": sum(input_lens) / seconds,
            "output_tok_per_s": output_tokens / seconds,
            # Where the seconds went, by the kind of step (a mixed step counts as a prefill step, apart too): the
            # engine's own counters, each step call's wall time.
            "steps": {name: getattr(llm.stats, name) - getattr(before, name) for name in THROUGHPUT_COUNTERS},
        }
        llm.close()
        del llm, outputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**results.pop("default"), **results}


@torch.inference_mode()
def measure_spec(model_dir: Path, workload: Workload, device: torch.device) -> dict:
    """`bench spec`'s oracle part with CUDA graphs (decode and verify captured): plain decode, then oracle drafts all
    right and none right, side by side (`a4.bench.spec.side_by_side`: tokens per step over the median step), per
    batch size. The drafts are a plain run's own greedy tokens (see the module docstring)."""
    from a4 import SamplingParams
    from a4.bench.engine import A4Runner, random_prompts
    from a4.bench.spec import NO_SPECULATION, System, side_by_side
    from a4.models.config import load_model_config
    from a4.speculative.drafter import OracleDrafter

    config = load_model_config(model_dir)
    k, new_tokens = workload.spec_tokens, workload.spec_new_tokens
    prompts = random_prompts([workload.prompt_len] * max(workload.spec_batches), config.vocab_size,
                             config.eos_token_ids, seed=1)  # fmt: skip
    options = dict(
        max_prefill_tokens=MAX_PREFILL_TOKENS, device=device, max_running_requests=max(workload.spec_batches),
        cuda_graphs=True,
        # Two engines side by side: on a GPU each gets a budget of its own, where the default would plan 80% of
        # what the first left free.
        memory_budget_bytes=SPEC_MEMORY_BUDGET if device.type == "cuda" else None,
    )  # fmt: skip
    plain = A4Runner(model_dir, DTYPE_NAME, **options)
    speculative = A4Runner(model_dir, DTYPE_NAME, speculative_tokens=k, **options)
    decode = []
    for batch in workload.spec_batches:
        # The drafts are a plain run's greedy tokens, k more than decoded for the last verify steps, from a run of
        # this batch: in bfloat16 the tokens of a decode step depend on the rows it has (cuBLAS chooses its GEMM by
        # them), and a verify at batch b computes what decode steps at batch b compute.
        outputs = plain.llm.generate(prompts[:batch], SamplingParams(max_new_tokens=new_tokens + k, ignore_eos=True))
        continuations = {tuple(p): out.token_ids for p, out in zip(prompts[:batch], outputs)}
        systems = {NO_SPECULATION: System(plain)} | {
            f"k={k}, {right}/{k} right": System(speculative, OracleDrafter(continuations, right, config.vocab_size))
            for right in (k, 0)
        }
        decode.append(side_by_side(systems, prompts[:batch], new_tokens, workload.spec_repeats))
    return {"k": k, "new_tokens": new_tokens, "decode": decode}


def measure_moe(workload: Workload, device: torch.device) -> dict:
    """a4 with CUDA graphs at Qwen3.5-MoE's shapes (workload.moe_preset), its random weights drawn where it runs:
    prefill and decode times, the launch profile on CUDA, and the model's bytes for the floor."""
    from a4.bench.engine import A4Runner
    from a4.models.config import load_model_config

    model_dir = moe_config_dir(workload)
    start = time.perf_counter()
    runner = A4Runner(
        model_dir, DTYPE_NAME, max_prefill_tokens=MAX_PREFILL_TOKENS, device=device,
        max_running_requests=max(workload.moe_batches), cuda_graphs=True, load_format="dummy",
    )  # fmt: skip
    print(f"moe part: the {workload.moe_preset} engine built in {time.perf_counter() - start:.0f} s, its memory plan:\n"
          f"{runner.llm.engine.memory_plan.describe()}", flush=True)  # fmt: skip
    config = load_model_config(model_dir)
    result = time_runner(runner, config, workload, workload.moe_batches, device, profile=device.type == "cuda")
    return {**result, "preset": workload.moe_preset,
            "model_bytes": asdict(ModelBytes.of(runner.llm.engine.model, config, DTYPE))}  # fmt: skip


@torch.inference_mode()
def measure_moe_spec(workload: Workload, device: torch.device) -> dict:
    """Plain decode at batch 1 against oracle drafts (all right, none right) and MTP drafts, k drafts per step for
    each k of workload.moe_spec_tokens, at Qwen3.5-MoE's shapes (workload.moe_preset, weights drawn where it runs):
    `a4.bench.spec`'s figures per system. Each engine runs its systems side by side and is released before the next
    is built; every engine draws the same weights (each tensor from a generator seeded by its name), so the plain
    engine's greedy tokens are every engine's."""
    import gc

    from a4 import SamplingParams
    from a4.bench.engine import A4Runner, random_prompts
    from a4.bench.spec import NO_SPECULATION, System, decode_results, decode_row
    from a4.models.config import load_model_config
    from a4.speculative.drafter import OracleDrafter

    model_dir = moe_config_dir(workload)
    config = load_model_config(model_dir)
    new_tokens, repeats, ks = workload.spec_new_tokens, workload.spec_repeats, workload.moe_spec_tokens
    prompts = random_prompts([workload.prompt_len], config.vocab_size, config.eos_token_ids, seed=1)
    options = dict(max_prefill_tokens=MAX_PREFILL_TOKENS, device=device, max_running_requests=1, cuda_graphs=True,
                   load_format="dummy")  # fmt: skip

    # Each engine lives in one of these two calls: when it returns, nothing refers to the engine any more.
    def plain_results() -> tuple[dict, dict]:
        plain = A4Runner(model_dir, DTYPE_NAME, **options)
        # The drafts: the plain engine's greedy tokens, max(ks) more than decoded for the last verify steps.
        output = plain.llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens + max(ks), ignore_eos=True))[0]
        results = decode_results({NO_SPECULATION: System(plain)}, prompts, new_tokens, repeats)
        return results, {tuple(prompts[0]): output.token_ids}

    def speculative_results(k: int, continuations: dict) -> dict:
        # Built with the model's MTP module as its drafter; the oracle's runs install theirs.
        spec = A4Runner(model_dir, DTYPE_NAME, speculative_tokens=k, **options)
        systems = {
            f"k={k}, {right}/{k} right": System(spec, OracleDrafter(continuations, right, config.vocab_size))
            for right in (k, 0)
        }
        systems[f"k={k}, MTP drafts"] = System(spec, spec.llm.engine.drafter)
        return decode_results(systems, prompts, new_tokens, repeats)

    results, continuations = plain_results()
    for k in ks:
        gc.collect()  # the last engine's cycles, and with them its tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results |= speculative_results(k, continuations)
    return {"preset": workload.moe_preset, "new_tokens": new_tokens, "decode": [decode_row(1, results)]}


def moe_config_dir(workload: Workload) -> Path:
    """config.json and generation_config.json of Qwen3.5-MoE at workload.moe_preset, and no weights: they are drawn
    on the device (load_format="dummy")."""
    return make_checkpoint(None, "qwen3_5_moe", preset=workload.moe_preset, weights=False)


def make_runner(name: str, model_dir: Path, workload: Workload, device: torch.device):
    from a4.bench.engine import A4Runner, TransformersRunner

    if name in A4_SYSTEMS:
        return A4Runner(
            model_dir,
            DTYPE_NAME,
            max_prefill_tokens=MAX_PREFILL_TOKENS,
            device=device,
            max_running_requests=max(workload.batches),
            # On a CPU, cuda_graphs=True runs the static decode buffers without capture, False the plain decode.
            **A4_SYSTEMS[name],
        )
    runner = TransformersRunner(model_dir, DTYPE_NAME, device=device)
    if (name == "transformers_fla") != kernel_package_imported("fla"):
        raise RuntimeError(
            f"{name}: transformers {'did not import' if name == 'transformers_fla' else 'imported'} "
            "flash-linear-attention"
        )
    return runner


def block_kernel_packages() -> None:
    """Make flash-linear-attention and causal-conv1d unimportable in this process, installed or not.

    A None in sys.modules makes `import fla` raise ImportError and `importlib.util.find_spec("fla")` return None:
    the two ways transformers' releases look for these packages. It must come before transformers imports its
    Qwen3.5 model code, which picks its Gated DeltaNet functions once; `make_runner` checks that it did.
    """
    for package in TRANSFORMERS_KERNEL_PACKAGES:
        sys.modules[package] = None


def kernel_package_imported(package: str) -> bool:
    return any(
        module is not None and (name == package or name.startswith(package + "."))
        for name, module in list(sys.modules.items())
    )


# Kernels by name in a launch profile's table, those of most GPU time first.
TOP_KERNELS = 15
# New tokens of each profiled request: enough that every request of a batch is still decoding at the profiled step,
# even where the scheduler decoded the first ones between the prefill chunks of the others.
PROFILE_NEW_TOKENS = 8


def step_profiles(
    engine, prefill_prompts: list[list[int]], decode_prompts: list[list[int]], batches: tuple[int, ...], times: dict
) -> list[dict]:
    """The launch profile of every step timed in `times` (time_runner's result): the prefill of each prompt and the
    decode step at each batch size, each against its wall time there."""
    prefills = [
        {"step": "prefill", "batch": 1, "tokens": len(prompt),
         **launch_profile(engine, [prompt], "prefill", times["prefill_ms"][str(len(prompt))])}
        for prompt in prefill_prompts
    ]  # fmt: skip
    decodes = [
        {"step": "decode", "batch": batch, "tokens": batch,
         **launch_profile(engine, decode_prompts[:batch], "decode", times["decode_ms"][str(batch)])}
        for batch in batches
    ]  # fmt: skip
    return prefills + decodes


def launch_profile(engine, prompts: list[list[int]], step: str, wall_ms: float) -> dict:
    """The GPU kernels of one engine step (torch.profiler): count, summed time, the TOP_KERNELS names of most time
    with their calls, beside the step's wall time, wall_ms (timed unprofiled: the profiler's own work would inflate
    it). `step`: "prefill", the first step of the prompts (one prompt: one prefill); "decode", a decode step of all of
    them, after their prefills and one decode step (captured graphs warm). On a CPU (the tests) it profiles the
    same step and finds no GPU kernels."""
    from torch.profiler import ProfilerActivity, profile

    from a4 import SamplingParams

    on_cuda = engine.runner.device.type == "cuda"
    params = SamplingParams(max_new_tokens=PROFILE_NEW_TOKENS, ignore_eos=True)
    reqs = [engine.add_request(prompt, params) for prompt in prompts]
    if step == "decode":
        while not all(req.output_ids for req in reqs):
            engine.step()  # the prefills
        engine.step()
    stats = engine.stats
    before = (stats.prefill_steps, stats.decode_steps, stats.decode_request_steps)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_cuda) as prof:
        engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    ran = (stats.prefill_steps - before[0], stats.decode_steps - before[1], stats.decode_request_steps - before[2])
    expected = (1, 0, 0) if step == "prefill" else (0, 1, len(prompts))
    if ran != expected:
        raise RuntimeError(f"the profiled step was not the {step} step of {len(prompts)} requests: "
                           f"(prefill steps, decode steps, requests decoded) {ran}, expected {expected}")  # fmt: skip
    replay_ms = graph_replay_ms(engine, len(prompts)) if step == "decode" and on_cuda else None
    if replay_ms is None:
        engine.run(reqs)
    else:
        for req in reqs:  # their states went on with the replays: nothing of them may be cached
            engine.abort_req(req)
        while engine.has_unfinished_requests:
            engine.step()
    kernels = cuda_kernels(prof)
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        by_name.setdefault(event.name, []).append(event.device_time_total / 1e3)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {
        "kernels": len(kernels),
        "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3,
        "wall_ms": wall_ms,
        **({} if replay_ms is None else {"graph_replay_ms": replay_ms}),
        "top_kernels": [{"name": name, "calls": len(times), "ms": sum(times)} for name, times in top],
    }


REPLAYS = 20


def graph_replay_ms(engine, batch: int) -> float | None:
    """The device's own time for a decode step of `batch` requests: its captured graph replayed REPLAYS times back
    to back, timed with CUDA events (the kernels and the device's launch gaps between them, no host work). The
    step's wall time minus this is the host's time the device waited for. None without a captured graph. The
    replays advance the live requests' states, which the caller then aborts."""
    runner = engine.graph_runner
    sizes = [size for mode, size in (runner.graphs if runner is not None else {}) if mode is ForwardMode.DECODE]
    bucket = min((size for size in sizes if size >= batch), default=None)
    if bucket is None:
        return None
    graph = runner.graphs[ForwardMode.DECODE, bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPLAYS


def cuda_kernels(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@torch.inference_mode()
def measure_context(model_dir: Path, workload: Workload, device: torch.device) -> dict:
    """One GDN layer, one attention layer and the whole model decoding one token at each context (ms).

    Each runs as in the engine's decode step (a4/engine/graph_runner.py): with the static runner's backend, so that
    the GDN layer updates its pool rows by slot (a4.layers.gdn_backend; Triton's kernels on CUDA) and attention reads
    the KV pool through the engine's backend for the device.
    """
    from a4.bench.decode_context import decode_batch, random_kv_pool
    from a4.engine.factories import create_backends
    from a4.kvcache.state_pool import StatePool
    from a4.models.registry import load_model

    config, model, _ = load_model(model_dir, dtype=DTYPE, device=device, progress=False)
    gdn = next(layer for layer in model.model.layers if layer.is_linear)
    attention = next(layer.self_attn for layer in model.model.layers if not layer.is_linear)
    kv_pool = random_kv_pool(config, len(config.full_attention_layers), max(workload.contexts) + 1, DTYPE, device)
    state_pool = StatePool(config, 1, DTYPE, device)
    hidden = torch.randn(1, config.hidden_size, generator=torch.Generator(device).manual_seed(0), device=device,
                         dtype=DTYPE)  # fmt: skip
    # The static-buffer runner's backend: the GDN layer updates its pool rows by slot, as in a captured step.
    static_backend = create_backends(config, device, DTYPE)[1]
    result: dict[str, list] = {"gdn_layer_ms": [], "attention_layer_ms": [], "step_ms": []}
    graphed = []
    for context in workload.contexts:
        fb = decode_batch(context, kv_pool, state_pool, static_backend)
        cos, sin = model.model.rotary_emb(fb.positions, DTYPE)
        runs = {
            "gdn_layer_ms": lambda: gdn.linear_attn(hidden, fb, gdn.pool_layer),
            "attention_layer_ms": lambda: attention(hidden, cos, sin, fb),
            "step_ms": lambda: model(fb),
        }
        for key, run in runs.items():
            ms, captured = call_ms(run, device, workload.repeats)
            result[key].append(ms)
            graphed.append(captured)
    print(f"context part: {sum(graphed)} of {len(graphed)} calls ran as CUDA graphs, the others eagerly")
    return result


def call_ms(run: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, bool]:
    """Milliseconds per call of run, as a CUDA graph where it captures (then True) and eagerly otherwise."""
    replay, captured = as_cuda_graph(run, device)
    return device_seconds(replay, device, repeats, inner=10) * 1e3, captured


def as_cuda_graph(run: Callable[[], object], device: torch.device) -> tuple[Callable[[], object], bool]:
    """(the replay of run captured in a CUDA graph, True), or (run, False) where it cannot be captured (a host sync,
    a CPU tensor, ... inside) or there is no CUDA."""
    if device.type != "cuda":
        return run, False
    # Warm up on a side stream (lazy initialisation, kernel autotuning), as torch.cuda.graphs' docs prescribe.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except Exception:  # noqa: BLE001 - what breaks a capture varies (RuntimeError, AcceleratorError, ...)
        torch.cuda.synchronize(device)
        return run, False
    return graph.replay, True


# -------------------------------------------------------------------------------------------- the whole benchmark


def main(
    quick: bool = False,
    out_dir: Path | None = None,
    system: str | None = None,
    parts_dir: Path | None = None,
    commit: str | None = None,
) -> dict:
    """Every part in its own process, then the table, <gpu>_gpu.json and .png in out_dir; returns the JSON.

    With `system`, this process is one part's: it measures that part and writes out_dir/PART.json. `parts_dir`: keep
    each part's JSON there and reuse the ones already there (`run_parts`). `commit`: what the report's meta names as
    the code measured (default: `tree_commit()`).
    """
    if not torch.cuda.is_available():
        raise Unavailable(
            f"it needs an NVIDIA GPU with CUDA, and torch.cuda.is_available() is False here (torch {torch.__version__})"
        )
    if system == "transformers":
        block_kernel_packages()  # first: before anything imports transformers' model code
    workload = Workload.quick() if quick else Workload.full()
    out_dir = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if system is not None:
        # The moe parts draw their own weights; the others share one checkpoint on disk.
        model_dir = None if system in MOE_PARTS else make_checkpoint(None, "qwen3_5", preset=workload.preset)
        result = run_part(system, model_dir, workload, torch.device("cuda"))
        (out_dir / f"{system}.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    parts = run_parts(quick, parts_dir)
    with_fla = "transformers_fla" in parts
    report = assemble(parts, workload, meta(parts["floor"]["device"], workload, with_fla, commit or tree_commit()))
    print_table(report)
    stem = f"{device_slug(report['meta']['device'])}_gpu{'_quick' if quick else ''}"
    write_report(out_dir, stem, report, plot)
    return report


def run_parts(quick: bool, parts_dir: Path | None = None) -> dict[str, dict]:
    """Each part in a fresh `python -m a4 bench gpu --system PART`, one after the other; the parts that ran.

    `parts_dir`: where each part's PART.json is kept (a scratch folder otherwise), and a part whose file is already
    there is read instead of run again. So a run cut short (the time limit of a lent GPU) goes on where it stopped.
    """
    parts = [part for part in PARTS if part != "transformers_fla" or installed_version(FLA_DISTRIBUTIONS)]
    if "transformers_fla" not in parts:
        print("flash-linear-attention is not installed: no transformers_fla system")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(parts_dir) if parts_dir is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for part in parts:
            done = folder / f"{part}.json"
            if done.exists():
                print(f"-- {part}: measured before, read from {done}", flush=True)
            else:
                print(f"-- {part}", flush=True)
                command = [sys.executable, "-m", "a4", "bench", "gpu", "--system", part, "--out", str(folder)]
                status = subprocess.run(command + (["--quick"] if quick else [])).returncode
                if status != 0:
                    print(f"-- {part} failed (exit status {status}): left out of the report", flush=True)
                    continue
            results[part] = json.loads(done.read_text())
    if "floor" not in results:
        raise RuntimeError("the floor part failed: nothing to compare the times with")
    return results


def installed_version(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of these distributions that is installed, or None."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def tree_commit(root: Path = REPO_ROOT) -> str:
    """The commit the measured code is: HEAD's short hash, with "+changes" when tracked files differ from it (a copy
    of the tree sent to another machine may carry an older .git), or "unknown" without a .git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + "+changes" if git("status", "--porcelain", "--untracked-files=no") else commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def meta(device: str, workload: Workload, with_fla: bool, commit: str) -> dict:
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": installed_version(("triton", "pytorch-triton")),
        "transformers": installed_version(("transformers",)),
        "fla": installed_version(FLA_DISTRIBUTIONS) if with_fla else None,
        "dtype": DTYPE_NAME,
        "shapes": workload.preset,
        "date": datetime.date.today().isoformat(),
        "commit": commit,
    }


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'h200': the device's name for file names."""
    return device.lower().removeprefix("nvidia ").replace(" ", "_")


def assemble(parts: dict[str, dict], workload: Workload, meta: dict) -> dict:
    """The report (the JSON notebook 10 reads) from the parts' results; systems that did not run are left out."""
    floor = parts["floor"]
    model_bytes = ModelBytes.from_dict(floor)
    report = {
        "meta": meta,
        "floor": {
            "hbm_bytes_per_s": floor["hbm_bytes_per_s"],
            "bf16_flop_per_s": floor["bf16_flop_per_s"],
            "weight_bytes": model_bytes.weight_bytes,
            "decode_floor_ms": decode_floor_ms(model_bytes, workload.batches, workload, floor),
            "prefill_floor_ms": prefill_floor_ms(model_bytes, workload.prefill_lens, floor),
        },
        "systems": {
            name: {"prefill_ms": parts[name]["prefill_ms"], "decode_ms": parts[name]["decode_ms"]}
            for name in SYSTEMS
            if name in parts
        },
    }
    if "throughput" in parts:
        report["throughput"] = parts["throughput"]
    if "spec" in parts:
        report["speculative"] = parts["spec"]
    if "moe" in parts:
        report["moe"] = moe_report(parts["moe"], floor, workload)
    if "moe_spec" in parts:
        report["moe_speculative"] = parts["moe_spec"]
    if "context" in parts:
        report["decode_vs_context"] = {"context": list(workload.contexts), "batch": 1, **parts["context"]}
    report["launch_profile"] = [
        {"system": name, **profile}
        for name in ("a4_no_graphs", "a4_no_overlap", "a4")
        for profile in with_floors(parts.get(name, {}).get("launch_profile", []), report["floor"])
    ]
    return report


def decode_floor_ms(model_bytes: ModelBytes, batches, workload: Workload, floor: dict) -> dict[str, float]:
    """The decode floor (ms) at each batch size, keyed as the report keys it: the step's bytes at the copy rate."""
    bytes_per_ms = floor["hbm_bytes_per_s"] / 1e3
    return {str(batch): model_bytes.decode_bytes(batch, workload.decode_context) / bytes_per_ms for batch in batches}


def prefill_floor_ms(model_bytes: ModelBytes, prompt_lens, floor: dict) -> dict[str, float]:
    """The prefill floor (ms) of each prompt length, keyed as the report keys it: its GEMMs at the GEMM rate, or
    the weights it reads at the copy rate where that is longer (`ModelBytes.prefill_floor_seconds`)."""
    rates = floor["bf16_flop_per_s"], floor["hbm_bytes_per_s"]
    return {str(n): model_bytes.prefill_floor_seconds(int(n), *rates) * 1e3 for n in prompt_lens}


def with_floors(profiles: list[dict], floors: dict) -> list[dict]:
    """Each step profile with its step's floor_ms, from `floors` (the report's floor, or moe_report's): a prefill's
    by its tokens, a decode step's by its batch (its tokens)."""
    return [
        {**profile, "floor_ms": floors[f"{profile['step']}_floor_ms"][str(profile["tokens"])]} for profile in profiles
    ]


def moe_report(part: dict, floor: dict, workload: Workload) -> dict:
    """The moe part's times beside their floors, from the floor part's bandwidth and GEMM rate."""
    model_bytes = ModelBytes.from_dict(part["model_bytes"])
    report = {
        "preset": part["preset"],
        "weight_bytes": model_bytes.weight_bytes,
        "prefill_ms": part["prefill_ms"],
        "decode_ms": part["decode_ms"],
        "decode_floor_ms": decode_floor_ms(model_bytes, map(int, part["decode_ms"]), workload, floor),
        "prefill_floor_ms": prefill_floor_ms(model_bytes, part["prefill_ms"], floor),
    }
    report["launch_profile"] = with_floors(part.get("launch_profile", []), report)
    return report


def rows(report: dict) -> list[tuple[str, str, str]]:
    """(label, "prefill_ms" or "decode_ms", key) for each figure of a system, in the table's order."""
    floor = report["floor"]
    return [(step_label("prefill", n), "prefill_ms", n) for n in floor["prefill_floor_ms"]] + [
        (step_label("decode", b), "decode_ms", b) for b in floor["decode_floor_ms"]
    ]


def step_label(step: str, key: int | str) -> str:
    """A step's label in the tables: "prefill N tokens" (key: its tokens) or "decode batch B" (key: its batch)."""
    return f"prefill {key} tokens" if step == "prefill" else f"decode batch {key}"


def floor_ms(report: dict, kind: str, key: str) -> float:
    return report["floor"]["prefill_floor_ms" if kind == "prefill_ms" else "decode_floor_ms"][key]


def speedups(report: dict) -> dict[str, dict[str, float]]:
    """a4's speedup over each other system: {system: {row label: its time / a4's time}}."""
    systems = report["systems"]
    if "a4" not in systems:
        return {}
    return {
        name: {label: times[kind][key] / systems["a4"][kind][key] for label, kind, key in rows(report)}
        for name, times in systems.items()
        if name != "a4"
    }


def floor_fractions(report: dict) -> dict[str, dict[str, float]]:
    """The floor as a fraction of each time: {system: {row label: floor / time}} (1.0: the hardware flat out)."""
    return {
        name: {label: floor_ms(report, kind, key) / times[kind][key] for label, kind, key in rows(report)}
        for name, times in report["systems"].items()
    }


def print_table(report: dict) -> None:
    meta, floor, systems = report["meta"], report["floor"], report["systems"]
    print(
        f"\n{meta['device']}, {meta['dtype']}, Qwen3.5-{meta['shapes']} shapes (random weights); floor measured here: "
        f"{floor['hbm_bytes_per_s'] / 1e12:.2f} TB/s copy, {floor['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s bf16 GEMM"
    )
    names = list(systems)
    width = max(len(name) for name in [*names, "transformers"]) + 2

    def block(title: str, columns: dict[str, dict[str, float]], fmt: str, floor_column: bool = False) -> None:
        print(f"\n{title}")
        print(f"{'':<20}" + "".join(f"{name:>{width}}" for name in columns) + (f"{'floor':>{width}}" * floor_column))
        for label, kind, key in rows(report):
            line = f"{label:<20}" + "".join(f"{format(values[label], fmt):>{width}}" for values in columns.values())
            print(line + (f"{floor_ms(report, kind, key):>{width}.3f}" if floor_column else ""))

    times = {name: {label: systems[name][kind][key] for label, kind, key in rows(report)} for name in names}
    block("time, ms (prefill: median of the runs; decode: median step)", times, ".2f", floor_column=True)
    if speedups(report):
        block("a4's speedup: the other system's time / a4's", speedups(report), ".2f")
    block("fraction of the floor: floor time / time", floor_fractions(report), ".1%")

    if "decode_vs_context" in report:
        part = report["decode_vs_context"]
        print(f"\ndecode vs context, batch {part['batch']}, ms")
        print(f"{'context':>8}{'GDN layer':>12}{'attention layer':>18}{'whole step':>12}")
        for i, context in enumerate(part["context"]):
            print(
                f"{context:>8}{part['gdn_layer_ms'][i]:>12.3f}{part['attention_layer_ms'][i]:>18.3f}"
                f"{part['step_ms'][i]:>12.3f}"
            )
    if "throughput" in report:
        part = report["throughput"]
        print(
            f"\noffline throughput, {part['requests']} requests ({part['input_tokens']:,} prompt and "
            f"{part['output_tokens']:,} output tokens) in {part['seconds']:.1f} s: {part['input_tok_per_s']:,.0f} input "
            f"and {part['output_tok_per_s']:,.0f} output tok/s"
        )
        for variant in ("default", *(name for name in THROUGHPUT_VARIANTS if name in part)):
            run = part if variant == "default" else part[variant]
            steps = run.get("steps")  # reports before the counters have none
            split = "" if steps is None else (
                f": {steps['prefill_steps']} prefill steps ({steps['mixed_steps']} mixed) "
                f"{steps['prefill_seconds']:.1f} s, {steps['decode_steps']} decode steps "
                f"{steps['decode_seconds']:.1f} s")
            print(f"  {variant:<10} {run['output_tok_per_s']:>9,.0f} output tok/s in {run['seconds']:.1f} s{split}")
    if "speculative" in report:
        from a4.bench.spec import print_decode

        part = report["speculative"]
        print_decode(part, f"speculative decoding with CUDA graphs, k = {part['k']} oracle drafts")
    if "moe" in report:
        part = report["moe"]
        print(f"\na4 at Qwen3.5-MoE-{part['preset']} shapes ({part['weight_bytes'] / 1e9:.1f} GB of weights), ms")
        for kind in ("prefill", "decode"):
            for key, ms in part[f"{kind}_ms"].items():
                floor_time = part[f"{kind}_floor_ms"][key]
                print(f"{step_label(kind, key):<20}{ms:>10.2f}  floor {floor_time:.3f} ({floor_time / ms:.1%})")
    if "moe_speculative" in report:
        from a4.bench.spec import print_decode

        part = report["moe_speculative"]
        print_decode(part, f"speculative decoding at Qwen3.5-MoE-{part['preset']} shapes, oracle and MTP drafts")
    profiles = [*report["launch_profile"]]
    if report.get("moe"):
        moe = report["moe"]
        profiles += [{"system": f"a4, MoE {moe['preset']}", **row} for row in moe["launch_profile"]]
    if profiles:
        print("\nlaunch profiles: the GPU kernels of one step, their summed time, the step's wall time and its floor")
    for row in profiles:
        print(
            f"{row['system']}, {step_label(row['step'], row['tokens'])}: {row['kernels']} GPU kernels running "
            f"{row['kernel_ms']:.2f} ms of a {row['wall_ms']:.2f} ms step ({row['kernel_ms'] / row['wall_ms']:.0%}; "
            f"the host's and the gaps {row['wall_ms'] - row['kernel_ms']:.2f} ms); floor {row['floor_ms']:.3f} ms, "
            f"the kernels at {row['kernel_ms'] / row['floor_ms']:.1f}x it"
        )
        if "graph_replay_ms" in row:
            replay = row["graph_replay_ms"]
            print(f"  its graph replayed back to back: {replay:.3f} ms a step (kernels and the device's launch gaps); "
                  f"the device waited {max(row['wall_ms'] - replay, 0):.3f} ms for the host")
        # The kernels by name of the captured engines only: without graphs a4 runs the same ones.
        if row["system"] != "a4_no_graphs":
            for kernel in row.get("top_kernels", []):
                print(f"  {kernel['calls']:>5} x {kernel['ms']:7.3f} ms  {kernel['name'][:90]}")


def draw(report: dict, axes) -> None:
    """Decode step vs batch, prefill, decode vs context and the launch profile, on four matplotlib axes."""
    decode_ax, prefill_ax, context_ax, launch_ax = axes
    floor, systems = report["floor"], report["systems"]
    batches = [int(b) for b in floor["decode_floor_ms"]]
    for name, times in systems.items():
        decode_ax.plot(batches, list(times["decode_ms"].values()), marker="o", label=name)
    decode_ax.plot(batches, list(floor["decode_floor_ms"].values()), "k--", label="floor (bytes / bandwidth)")
    decode_ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per decode step")
    decode_ax.set_xticks(batches, [str(b) for b in batches])
    decode_ax.minorticks_off()
    decode_ax.set_title("decode step", loc="left", fontsize=10)
    decode_ax.legend(fontsize=7)

    lens = list(floor["prefill_floor_ms"])
    width = 0.8 / (len(systems) + 1)
    for i, (name, values) in enumerate([*((n, t["prefill_ms"]) for n, t in systems.items()),
                                        ("floor (GEMM FLOP or weight bytes)", floor["prefill_floor_ms"])]):  # fmt: skip
        prefill_ax.bar([j + i * width for j in range(len(lens))], [values[n] for n in lens], width, label=name)
    prefill_ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lens))], [f"{n} tokens" for n in lens])
    prefill_ax.set(yscale="log", ylabel="ms per prefill")
    prefill_ax.set_title("prefill of one prompt", loc="left", fontsize=10)
    prefill_ax.legend(fontsize=7)

    if "decode_vs_context" in report:
        part = report["decode_vs_context"]
        for key, label in (("gdn_layer_ms", "one GDN layer"), ("attention_layer_ms", "one attention layer"),
                           ("step_ms", "whole step")):  # fmt: skip
            context_ax.plot(part["context"], part[key], marker="o", label=label)
        context_ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms")
        context_ax.legend(fontsize=7)
    context_ax.set_title("decode vs context, batch 1", loc="left", fontsize=10)

    profile = [row for row in report["launch_profile"] if row["system"] == "a4"]
    if not profile:
        launch_ax.text(0.5, 0.5, "no launch profile: a4 ran on no GPU", ha="center", transform=launch_ax.transAxes)
    # Short labels under the bars: "prefill\n512", "decode\nb8".
    labels = [step_label(row["step"], row["tokens"]).replace(" tokens", "").replace("batch ", "b").replace(" ", "\n")
              for row in profile]  # fmt: skip
    positions = range(len(profile))
    launch_ax.bar(positions, [row["wall_ms"] for row in profile], 0.7, label="wall time of the step")
    bars = launch_ax.bar(positions, [row["kernel_ms"] for row in profile], 0.45, label="GPU kernels' summed time")
    launch_ax.bar_label(bars, [f"{row['kernels']}" for row in profile], fontsize=6)
    launch_ax.scatter(positions, [row["floor_ms"] for row in profile], color="k", marker="_", s=200, zorder=3,
                      label="floor")  # fmt: skip
    launch_ax.set_xticks(list(positions), labels, fontsize=7)
    launch_ax.set(yscale="log", ylabel="ms")
    launch_ax.set_title("a4's steps (CUDA graphs), kernels per step on the bars", loc="left", fontsize=10)
    launch_ax.legend(fontsize=7)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    draw(report, axes.flat)
    meta = report["meta"]
    fig.suptitle(f"a4 vs transformers on {meta['device']}, {meta['dtype']}, Qwen3.5-{meta['shapes']} shapes",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
