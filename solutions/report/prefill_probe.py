"""The captured prefill of one request against the eager prefill, side by side: a one-off probe of REPORT.md §5.

Not a part of `python -m a4 bench gpu`: run from the repository root on a machine with a GPU (and fla installed),

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/prefill_probe.py

It builds two engines in one process (Qwen3.5-0.8B shapes, random weights, bf16, CUDA graphs): "captured" as a4 is,
"eager" with the static runner's prefill turned off, so that its prefills run the eager varlen path. They take turns
prefilling one prompt of each length (median of 5 after one warm-up, one new token), then generate 16 tokens from
8 prompts each (greedy: do they agree?), and torch.profiler lists the kernels of one 2,048-token prefill of each.
It prints; nothing is written.
"""

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from a4 import LLM, SamplingParams
from a4.checkpoints import make_checkpoint
from a4.kernels.fla_prefill import fla_available

print("fla", fla_available(), flush=True)
ckpt = make_checkpoint(None, "qwen3_5", preset="0.8b")
engines = {}
for name in ("captured", "eager"):
    start = time.perf_counter()
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", max_prefill_tokens=8192, enable_prefix_cache=False,
              max_running_requests=8)  # fmt: skip
    print(f"{name} built in {time.perf_counter() - start:.1f} s; graphs {len(llm.engine.graph_runner.graphs)}")
    if name == "eager":
        llm.engine.graph_runner.takes_prefill = lambda prefix_lens, extend_lens: False
    engines[name] = llm
generator = torch.Generator().manual_seed(0)
one_token = SamplingParams(max_new_tokens=1, ignore_eos=True)
for length in (17, 100, 512, 2048, 3000, 8192):
    prompt = torch.randint(0, 1000, (length,), generator=generator).tolist()
    times = {name: [] for name in engines}
    for _ in range(6):
        for name, llm in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], one_token)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
    print(f"prefill {length}: captured {ms['captured']:.2f} ms, eager {ms['eager']:.2f} ms, "
          f"eager/captured {ms['eager'] / ms['captured']:.2f}x", flush=True)  # fmt: skip

prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (5, 40, 300, 700, 1500, 2048, 16, 64)]
sixteen = SamplingParams(max_new_tokens=16, ignore_eos=True)
outs = {name: [out.token_ids for out in llm.generate(prompts, sixteen)] for name, llm in engines.items()}
pairs = list(zip(outs["captured"], outs["eager"]))
same = sum(a == b for a, b in pairs)
agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in pairs)
print(f"bf16 captured vs eager prefill: {same}/8 requests identical, {agree}/128 tokens before the first difference")

prompt = torch.randint(0, 1000, (2048,), generator=generator).tolist()
for name, llm in engines.items():
    llm.generate([prompt], one_token)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], one_token)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for event in kernels:
        by_name.setdefault(event.name, []).append(event.device_time_total / 1e3)
    print(f"{name} 2048 prefill: {len(kernels)} kernels, {sum(e.device_time_total for e in kernels) / 1e3:.2f} ms GPU")
    for kernel, ms in sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]:
        print(f"   {sum(ms):7.3f} ms {len(ms):4d}x {kernel[:110]}")
