"""Speculative decoding on one GPU, captured: tokens/s against plain decode, bfloat16, Qwen3.5-0.8B shapes.

A one-off probe for REPORT.md (not a `python -m a4 bench`: those run on the course's CPU), run from the repository
root on a machine with a GPU:

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/spec_gpu_probe.py OUT.json

With random weights an MTP module drafts nothing useful, so acceptance is forced: oracle drafts taken from a plain
run's own greedy tokens (all of them right, as far as the verify pass computes what the decode step computes) and
the same drafts made wrong (none accepted). Each configuration decodes 64 tokens for a batch of 1 and of 8 prompts of
128 tokens after their prefill; the figure is output tokens over the decode steps' time (median step x steps is
avoided: speculation changes how many steps there are). CUDA graphs on (plain decode and verify captured) and off,
side by side in one process.
"""

from __future__ import annotations

import json
import sys

import torch

from a4 import LLM, SamplingParams
from a4.bench.engine import random_prompts
from a4.checkpoints import make_checkpoint
from a4.models.config import load_model_config
from a4.speculative.drafter import OracleDrafter

DTYPE = "bfloat16"
NEW_TOKENS = 64
K = 3


def decode_tokens_per_second(llm: LLM, prompts: list[list[int]]) -> tuple[float, dict]:
    """Output tokens per second of decode (the prefill's first token and time left out), and the engine's counters."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: kernels compiled, graphs' first replay
    llm.engine.stats = type(llm.engine.stats)()
    torch.cuda.synchronize()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    stats = llm.stats
    return stats.decode_tokens / stats.decode_seconds, {
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_decode_step": stats.tokens_per_decode_step,
        "decode_steps": stats.decode_steps,
    }


def main(out_path: str) -> None:
    model_dir = make_checkpoint(None, "qwen3_5", preset="0.8b")
    config = load_model_config(model_dir)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "k": K, "new_tokens": NEW_TOKENS, "runs": []}
    for batch in (1, 8):
        prompts = random_prompts([128] * batch, config.vocab_size, config.eos_token_ids, seed=batch)
        for graphs in (True, False):
            # A budget of its own for each engine: the default takes 80% of what is free, and two engines in turn.
            options = dict(device="cuda", dtype=DTYPE, cuda_graphs=graphs, max_running_requests=8,
                           memory_budget_bytes=16 << 30)  # fmt: skip
            plain = LLM(model_dir, **options)
            truth = plain.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS + K, ignore_eos=True))
            plain_rate, _ = decode_tokens_per_second(plain, prompts)
            del plain
            torch.cuda.empty_cache()
            continuations = {tuple(p): out.token_ids for p, out in zip(prompts, truth)}
            for correct in (K, 0):
                drafter = OracleDrafter(continuations, correct=correct, vocab_size=config.vocab_size)
                spec = LLM(model_dir, drafter=drafter, speculative_tokens=K, **options)
                rate, counters = decode_tokens_per_second(spec, prompts)
                row = dict(batch=batch, cuda_graphs=graphs, drafts_right=correct, plain_tok_s=plain_rate,
                           spec_tok_s=rate, speedup=rate / plain_rate, **counters)  # fmt: skip
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
                del spec
                torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
