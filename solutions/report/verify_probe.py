"""What batch invariance costs, and where a verify step's time goes: a one-off probe of solutions/REPORT.md §5.

Not a part of `python -m a4 bench gpu`: run from the repository root on a machine with a GPU,

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/verify_probe.py OUT_DIR

It builds, in one process, Qwen3.5-0.8B-shape engines with random weights drawn on the GPU (bf16, CUDA graphs):
- "every": a4 as it is, every projection of at most MAX_ROWS rows through the gemv kernel (a verify step's rows
  then come out as the decode steps' rows do);
- "narrow": the rule before, only the narrow outputs through gemv, the wide ones (merged input projections, lm_head)
  through cuBLAS;
and times their decode steps at batch 1 and 4, three rounds taking turns (median step of 40 each). Then a speculative
engine (k = 3, oracle drafts from the "every" engine's own greedy tokens) times its verify steps with no draft and
every draft right, and torch.profiler lists the kernels of one verify step and of one decode step of each engine, and
the host's operations of one verify step. It writes OUT_DIR/probe.json.
"""

import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import a4.kernels.gemv as gemv_module
from a4 import SamplingParams
from a4.bench.engine import A4Runner, random_prompts
from a4.bench.gpu import launch_profile
from a4.checkpoints import make_checkpoint
from a4.models.config import load_model_config
from a4.speculative.drafter import OracleDrafter


def narrow_only(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemv.linear's rule before batch invariance: the kernel only for narrow outputs."""
    few_rows = x.numel() <= gemv_module.MAX_ROWS * x.shape[-1]
    if x.is_cuda and few_rows and weight.shape[0] <= weight.shape[1] and weight.stride(1) == 1:
        return gemv_module.gemv(x, weight)
    return F.linear(x, weight)


def main(out_dir: str) -> None:
    model_dir = make_checkpoint(None, "qwen3_5", preset="0.8b", weights=False)
    config = load_model_config(model_dir)
    prompts = random_prompts([128] * 4, config.vocab_size, config.eos_token_ids, seed=0)
    options = dict(max_prefill_tokens=8192, device="cuda", max_running_requests=4, cuda_graphs=True,
                   load_format="dummy", memory_budget_bytes=16 << 30)  # fmt: skip
    # gemv.linear is looked up when an engine routes its layers and captures its graphs: each engine keeps its rule.
    every = gemv_module.linear
    engines = {}
    for name, rule in (("every", every), ("narrow", narrow_only)):
        gemv_module.linear = rule
        engines[name] = A4Runner(model_dir, "bfloat16", **options)
    gemv_module.linear = every

    out = {"steps_ms": {}}
    for _ in range(3):
        for name, runner in engines.items():
            for batch in (1, 4):
                seconds = runner.decode_step_seconds(prompts[:batch], 41)
                out["steps_ms"].setdefault(f"{name} b{batch}", []).append(statistics.median(seconds) * 1e3)
    for key, times in out["steps_ms"].items():
        print(f"{key:12s} " + " ".join(f"{t:.3f}" for t in times), flush=True)

    plain = engines["every"].llm.generate(prompts[:1], SamplingParams(max_new_tokens=70, ignore_eos=True))
    continuations = {tuple(prompts[0]): plain[0].token_ids}
    spec = A4Runner(model_dir, "bfloat16", speculative_tokens=3, **options)
    for right in (0, 3):
        spec.llm.engine.worker.drafter = OracleDrafter(continuations, right, config.vocab_size)
        step_ms = statistics.median(spec.decode_step_seconds(prompts[:1], 64)) * 1e3
        out[f"verify_step_ms_{right}_right"] = step_ms
        print(f"verify step, {right}/3 right: {step_ms:.3f} ms", flush=True)

    spec.llm.engine.worker.drafter = OracleDrafter(continuations, 0, config.vocab_size)
    profiled = [
        ("verify", spec.llm.engine, out["verify_step_ms_0_right"]),
        ("decode_every", engines["every"].llm.engine, statistics.median(out["steps_ms"]["every b1"])),
        ("decode_narrow", engines["narrow"].llm.engine, statistics.median(out["steps_ms"]["narrow b1"])),
    ]
    for name, engine, wall_ms in profiled:
        result = launch_profile(engine, prompts[0], wall_ms)
        out[f"profile_{name}"] = result
        print(f"{name}: {result['kernels']} kernels, {result['kernel_ms']:.3f} ms GPU of {wall_ms:.3f} ms", flush=True)
        for kernel in result["top_kernels"]:
            print(f"   {kernel['calls']:4d} x {kernel['ms']:.3f} ms {kernel['name'][:90]}")

    engine = spec.llm.engine
    req = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a first verify step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    engine.run([req])
    out["verify_host_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(out["verify_host_table"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        f.write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
