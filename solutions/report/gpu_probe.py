"""The GPU figures of solutions/REPORT.md: a4 and transformers on one H200, bfloat16, Qwen3.5-0.8B shapes.

Not a benchmark of `python -m a4 bench` (those run on the CPU of the course): a one-off probe, run from the
repository root on a machine with a GPU, with torch and transformers installed there:

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/gpu_probe.py OUT.json

It builds the 0.8B-shape random-weight checkpoint, then times (CUDA-synchronised, median of the runs after a
warm-up): a4's prefill of 512 and 2048 tokens with the chunked GDN form and with the recurrence; a4's decode step
at batch 1 and 8 and the CUDA kernels one step launches; the same prefill and decode through transformers'
`generate`; and one GDN layer against one attention layer decoding at contexts up to 128k tokens.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from a4 import SamplingParams
from a4.bench.decode_context import decode_batch, random_kv_pool
from a4.bench.engine import A4Runner, TransformersRunner, random_prompts
from a4.bench.prefill import recurrence_in_prefill
from a4.checkpoints import make_checkpoint
from a4.models.config import load_model_config
from a4.models.registry import load_model

DTYPE = "bfloat16"
DEVICE = torch.device("cuda")


def seconds(run, repeats: int) -> float:
    """Median wall time of `run` over `repeats` calls after a warm-up, each call waited for on the GPU."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(out_path: str) -> None:
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "memory_bytes": torch.cuda.mem_get_info()}
    model_dir = make_checkpoint(None, "qwen3_5", preset="0.8b")
    config = load_model_config(model_dir)
    lengths = (512, 2048, 128, *range(16, 129, 16))
    prompt_512, prompt_2048, decode_prompt, *batch = random_prompts(
        lengths, config.vocab_size, config.eos_token_ids, seed=0
    )

    a4 = A4Runner(model_dir, DTYPE, max_prefill_tokens=2048, device=DEVICE)
    out["a4 memory plan"] = a4.llm.memory_plan.describe()
    for n, prompt in ((512, prompt_512), (2048, prompt_2048)):
        out[f"a4 prefill {n} chunked s"] = seconds(lambda: a4.prefill(prompt), 5)
        with recurrence_in_prefill():
            out[f"a4 prefill {n} recurrence s"] = seconds(lambda: a4.prefill(prompt), 2)
    a4.decode_step_seconds([decode_prompt], 4)
    out["a4 decode b1 step s"] = statistics.median(a4.decode_step_seconds([decode_prompt], 64))
    out["a4 decode b8 step s"] = statistics.median(a4.decode_step_seconds(batch, 64))
    engine = a4.llm.engine
    reqs = [engine.add_request(decode_prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    out["a4 decode b1 kernels per step"] = len(kernels)
    out["a4 decode b1 kernel time s"] = sum(e.device_time_total for e in kernels) / 1e6
    engine.run(reqs)
    del a4, engine
    torch.cuda.empty_cache()

    hf = TransformersRunner(model_dir, DTYPE, device=DEVICE)
    out["hf prefill 512 s"] = seconds(lambda: hf.prefill(prompt_512), 5)
    out["hf prefill 2048 s"] = seconds(lambda: hf.prefill(prompt_2048), 3)
    hf.decode_step_seconds([decode_prompt], 4)
    out["hf decode b1 step s"] = statistics.median(hf.decode_step_seconds([decode_prompt], 64))
    out["hf decode b8 step s"] = statistics.median(hf.decode_step_seconds(batch, 64))
    del hf
    torch.cuda.empty_cache()

    dtype = getattr(torch, DTYPE)
    config, model, _ = load_model(model_dir, dtype=dtype, device=DEVICE, progress=False)
    gdn = next(layer.linear_attn for layer in model.model.layers if layer.is_linear)
    attention = next(layer.self_attn for layer in model.model.layers if not layer.is_linear)
    contexts = (1024, 4096, 16384, 32768, 131072)
    kv_pool = random_kv_pool(config, 1, max(contexts) + 1, dtype, DEVICE)
    hidden = torch.randn(1, config.hidden_size, device=DEVICE, dtype=dtype)
    conv_state = torch.zeros(1, config.conv_dim, config.linear_conv_kernel_dim - 1, device=DEVICE, dtype=dtype)
    recurrent_state = torch.zeros(
        1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim, device=DEVICE
    )
    with torch.inference_mode():
        for n in contexts:
            fb = decode_batch(n, kv_pool)
            cos, sin = model.model.rotary_emb(fb.positions, dtype)
            out[f"layer gdn {n} s"] = seconds(lambda: gdn(hidden, fb, conv_state, recurrent_state), 20)
            out[f"layer attn {n} s"] = seconds(lambda: attention(hidden, cos, sin, fb), 20)
    print(json.dumps(out, indent=1))
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
