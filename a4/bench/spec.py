"""Benchmark: speculative decoding (notebook 11), what it gains and what it costs, each ratio measured in one run.

Three parts:
- MTP drafts, each checkpoint with its own multi-token-prediction module (`LLM(model_dir, speculative_tokens=k)`,
  float32): the acceptance rate and the tokens a request gains per decode step for k = 1, 2, 3 on held-out prompts,
  then decode tokens/s at batch 1 and 8, k = 1, 2, 3 beside no speculation. Two checkpoints: the random-weight tiny
  Qwen3.5, on random token prompts (random MTP weights draft nonsense: acceptance ~0), and the trained tiny Qwen3.5
  (a4/trained, `python -m a4.train_tiny`), on the starts of held-out documents of its corpus (chats up to their first
  answer, stories and facts after their first sentence; a4/tiny_corpus.py, a seed of their own). Past an answer's
  end the trained model goes on as in training, with more documents.
- Forced acceptance, at Qwen3.5-0.8B's shapes (random weights, float32): an `OracleDrafter` makes k = 2 drafts per
  request per step of which the first 0, 1 or 2 are right, i.e. 0%, 50% or 100% accepted, every step alike; decode
  tokens/s at batch 1 and 8 beside no speculation. k = 2 rather than 4 (with 0, 2, 4 right): the same three rates, and a
  batch-8 verify of 24 rows instead of 40, which keeps the run short. The oracle's continuations are a
  non-speculative run's greedy output; its drafts cost nothing, so these figures are the verify pass alone. Beside
  them the same engine drafts with the checkpoint's MTP module (random weights: nothing accepted), whose step against
  the oracle's 0-right step is the cost of drafting (the MTP module runs one decoder layer and the lm_head per draft).
- Memory: the ledger (`engine.memory_plan.ledger`) of 0.8B engines in bfloat16 with the MTP drafter at k = 0, 1, 2, 3:
  a slot's state and the verify states (k + 1 states per GDN layer per slot), the MTP layer's KV per token, and how
  many requests of 4k and 32k tokens the pool budget of one H200 then holds (notebook 08's budget, less the MTP
  module's weights).

Decode tokens/s of a system: the tokens its requests gained per decode step (all its runs together) over its median
decode step, each `Engine.step()` timed from outside (scheduling, drafting, the forward, verification and the commit),
as `bench engine` times decode. Every system runs once untimed, then `repeats` times, the systems of a part taking
turns; a speed-up is the ratio of two systems' tokens/s. The median step rather than a run's total time: a burst of
load from other processes on a shared machine lengthens a few steps, not the figure (a step costs the same whatever
the drafts accepted: each request always feeds k + 1 tokens). Greedy, end of sequence ignored, prefix cache off.
`--quick` runs every part on the tiny checkpoint, with few tokens.

    python -m a4 bench spec [--quick] [--out DIR]
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from a4.bench import write_report
from a4.bench.engine import A4Runner, random_prompts
from a4.checkpoints import make_checkpoint
from a4.engine.engine import EngineStats
from a4.models.config import load_model_config
from a4.speculative.drafter import Drafter, OracleDrafter

NO_SPECULATION = "no speculation"
SPECULATIVE_TOKENS = (1, 2, 3)  # k of the MTP part and of the memory part
ORACLE_K = 2
ORACLE_SYSTEMS = {f"k={ORACLE_K}, {right}/{ORACLE_K} right": right for right in range(ORACLE_K + 1)}
MTP_SYSTEM = f"k={ORACLE_K}, MTP drafts"
BATCHES = (1, 8)
TIMING_DTYPE = "float32"
MEMORY_DTYPE = "bfloat16"  # what a GPU serves; the memory part's engines are built for their ledger only
MEMORY_PART_BUDGET = 256 << 20  # the memory part's own pools: small, beside one slot of the largest ledger
# The oracle part's context at 0.8B: the memory plan sets aside one request of the model's whole context before a
# second slot (`plan_memory`), 6 GiB of float32 KV at 262k tokens, beyond the CPU's default budget: it would leave one
# slot. The runs need fewer than 100 tokens; the weights are the same (each tensor is seeded by its name).
ORACLE_CONTEXT = 1024
WARM_UP_TOKENS = 3  # each system's untimed run: a prefill and two decode steps, with drafts
ACCEPTANCE_SEED = 1013  # the held-out prompts: a seed of their own
MTP_PARTS = {"mtp": "random", "mtp_trained": "trained"}  # report key -> mtp_part's tiny checkpoint


@dataclass(frozen=True)
class Workload:
    preset: str  # shapes of the oracle and memory parts ("0.8b"; the quick run: "tiny")
    prompt_len: int  # every prompt of the timed runs
    mtp_new_tokens: int  # per request in each timed run of the MTP part
    oracle_new_tokens: int  # per request in each timed run of the oracle part
    repeats: int  # timed runs per system, after an untimed one
    acceptance_lens: tuple[int, ...]  # the held-out prompts of the MTP part's acceptance
    acceptance_new_tokens: int

    @staticmethod
    def full() -> Workload:
        return Workload(
            "0.8b", 32, 64, 16, repeats=3, acceptance_lens=tuple(range(8, 257, 8)), acceptance_new_tokens=64
        )

    @staticmethod
    def quick() -> Workload:
        return Workload("tiny", 8, 6, 6, repeats=1, acceptance_lens=(4, 8, 12, 16), acceptance_new_tokens=8)


@dataclass(frozen=True)
class System:
    """One column of a side-by-side run: an engine, and the drafter it runs with (None: the engine's own)."""

    runner: A4Runner
    drafter: Drafter | None = None


def decode_run(system: System, prompts: list[list[int]], new_tokens: int) -> dict:
    """Generate new_tokens for each prompt; this run's engine counters and the wall time of each decode step."""
    engine = system.runner.llm.engine
    if system.drafter is not None:
        # One 0.8B engine serves several drafters, one per run: every run starts with a prefill, which the drafter
        # observes, so a drafter never sees another's requests.
        engine.worker.drafter = system.drafter
    engine.stats = EngineStats()  # this run's counters only
    seconds = system.runner.decode_step_seconds(prompts, new_tokens)
    return {**asdict(engine.stats), "decode_step_seconds": seconds}


def pooled(runs: list[dict]) -> EngineStats:
    """The engine counters of several runs, added up."""
    return EngineStats(**{f.name: sum(run[f.name] for run in runs) for f in fields(EngineStats)})


def side_by_side(systems: dict[str, System], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s of each system (`repeats` runs, the systems taking turns), its acceptance and the tokens a
    request gains per decode step, over all its runs; each system's speed-up over no speculation."""
    return decode_row(len(prompts), decode_results(systems, prompts, new_tokens, repeats))


def decode_results(systems: dict[str, System], prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """`side_by_side`'s figures of each system, without the speed-ups (no speculation may be measured apart)."""
    for system in systems.values():
        decode_run(system, prompts, WARM_UP_TOKENS)  # first-call costs out of the figures, as in _timing
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, system in systems.items():
            runs[name].append(decode_run(system, prompts, new_tokens))
    results = {}
    for name, system_runs in runs.items():
        total = pooled(system_runs)
        step_seconds = statistics.median(s for run in system_runs for s in run["decode_step_seconds"])
        results[name] = {
            "tokens_per_s": total.decode_tokens / total.decode_steps / step_seconds,
            "acceptance_rate": total.acceptance_rate,
            "tokens_per_decode_step": total.tokens_per_decode_step,
            "runs": system_runs,
        }
    return results


def decode_row(batch: int, results: dict) -> dict:
    """One batch's row of a report's "decode": each system's figures and its speed-up over no speculation."""
    base = results[NO_SPECULATION]["tokens_per_s"]
    return {
        "batch": batch,
        "systems": results,
        "speedup": {name: result["tokens_per_s"] / base for name, result in results.items()},
    }


def timed_prompts(model_dir: Path, workload: Workload) -> list[list[int]]:
    config = load_model_config(model_dir)
    return random_prompts((workload.prompt_len,) * max(BATCHES), config.vocab_size, config.eos_token_ids, seed=0)


def random_checkpoint_prompts(workload: Workload) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The random-weight tiny checkpoint, its held-out prompts (random tokens) and its timed prompts."""
    from a4.checkpoints import tiny_checkpoint

    model_dir = tiny_checkpoint("qwen3_5")
    config = load_model_config(model_dir)
    held_out = random_prompts(workload.acceptance_lens, config.vocab_size, config.eos_token_ids, seed=ACCEPTANCE_SEED)
    return model_dir, held_out, timed_prompts(model_dir, workload)


def trained_checkpoint_prompts(workload: Workload) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The trained tiny checkpoint, the starts of held-out documents of its corpus as its held-out prompts (as many
    as the random checkpoint's), and the next max(BATCHES) of them as its timed prompts."""
    from tokenizers import Tokenizer

    from a4 import tiny_corpus
    from a4.checkpoints import tiny_checkpoint

    model_dir = tiny_checkpoint("qwen3_5", trained=True)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    count = len(workload.acceptance_lens)
    documents = tiny_corpus.documents(ACCEPTANCE_SEED, count + max(BATCHES))
    prompts = [tokenizer.encode(tiny_corpus.prompt_of(document)).ids for document in documents]
    return model_dir, prompts[:count], prompts[count:]


def mtp_part(workload: Workload, checkpoint: str) -> dict:
    """A checkpoint's own MTP drafts: acceptance on held-out prompts, then decode speed beside no speculation.
    checkpoint: "random" or "trained" (the tiny Qwen3.5 checkpoints)."""
    from a4 import SamplingParams

    prompts_of = {"random": random_checkpoint_prompts, "trained": trained_checkpoint_prompts}[checkpoint]
    model_dir, held_out, prompts = prompts_of(workload)
    runners = {
        k: A4Runner(model_dir, TIMING_DTYPE, max_prefill_tokens=512, speculative_tokens=k)
        for k in (0, *SPECULATIVE_TOKENS)
    }
    acceptance = {}
    for k in SPECULATIVE_TOKENS:
        engine = runners[k].llm.engine
        engine.stats = EngineStats()
        params = SamplingParams(max_new_tokens=workload.acceptance_new_tokens, ignore_eos=True)
        runners[k].llm.generate(held_out, params)
        stats = engine.stats
        acceptance[str(k)] = {
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_decode_step": stats.tokens_per_decode_step,
            **asdict(stats),
        }
    systems = {NO_SPECULATION if k == 0 else f"k={k}": System(runner) for k, runner in runners.items()}
    return {
        "shapes": "Qwen3.5-tiny" if checkpoint == "random" else "Qwen3.5-tiny, trained",
        "checkpoint": model_dir.name,
        "dtype": TIMING_DTYPE,
        "held_out_prompts": len(held_out),
        "acceptance": acceptance,
        "decode": [
            side_by_side(systems, prompts[:batch], workload.mtp_new_tokens, workload.repeats) for batch in BATCHES
        ],
    }


def oracle_part(workload: Workload) -> dict:
    """Acceptance forced by an oracle at 0%, 50% and 100%, and the MTP module's drafts: decode speed beside no
    speculation."""
    from a4 import SamplingParams

    overrides = {} if workload.preset == "tiny" else {"max_position_embeddings": ORACLE_CONTEXT}
    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset, **overrides)
    config = load_model_config(model_dir)
    prompts = timed_prompts(model_dir, workload)
    base = A4Runner(model_dir, TIMING_DTYPE, max_prefill_tokens=512)
    outputs = base.llm.generate(prompts, SamplingParams(max_new_tokens=workload.oracle_new_tokens, ignore_eos=True))
    continuations = {tuple(p): out.token_ids for p, out in zip(prompts, outputs)}
    # The checkpoint's MTP module drafts unless a run installs an oracle.
    spec = A4Runner(model_dir, TIMING_DTYPE, max_prefill_tokens=512, speculative_tokens=ORACLE_K)
    systems = {NO_SPECULATION: System(base)}
    systems |= {
        name: System(spec, OracleDrafter(continuations, correct=right, vocab_size=config.vocab_size))
        for name, right in ORACLE_SYSTEMS.items()
    }
    systems[MTP_SYSTEM] = System(spec, spec.llm.engine.drafter)
    return {
        "shapes": f"Qwen3.5-{workload.preset}",
        "checkpoint": model_dir.name,
        "dtype": TIMING_DTYPE,
        "k": ORACLE_K,
        "decode": [
            side_by_side(systems, prompts[:batch], workload.oracle_new_tokens, workload.repeats) for batch in BATCHES
        ],
    }


def memory_part(workload: Workload) -> dict:
    """The ledgers of engines with the MTP drafter at k = 0..3, and the requests one H200's pool budget holds."""
    from a4 import LLM
    from a4.course.checks.report import REPORT_CONTEXTS, pool_budget

    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset)
    dtype = getattr(torch, MEMORY_DTYPE)
    budget = pool_budget("qwen3_5", workload.preset, dtype)
    ledgers = {}
    for k in (0, *SPECULATIVE_TOKENS):
        llm = LLM(
            model_dir,
            dtype=MEMORY_DTYPE,
            speculative_tokens=k,
            enable_prefix_cache=False,
            memory_budget_bytes=MEMORY_PART_BUDGET,
        )
        ledger = llm.engine.memory_plan.ledger
        # The MTP module's own weights (its embedding and lm_head are the main model's) come out of the budget.
        mtp_weight_bytes = sum(p.nbytes for p in llm.engine.drafter.mtp.parameters()) if k else 0
        ledgers[str(k)] = {
            **asdict(ledger),
            "bytes_per_slot": ledger.bytes_per_slot,
            "mtp_kv_bytes_per_token": (ledger.kv_bytes_per_token - ledgers["0"]["kv_bytes_per_token"]) if k else 0,
            "mtp_weight_bytes": mtp_weight_bytes,
            "requests": {
                str(context): (budget - mtp_weight_bytes) // ledger.bytes_per_request(context)
                for context in REPORT_CONTEXTS
            },
        }
        del llm
        gc.collect()
    return {
        "shapes": f"Qwen3.5-{workload.preset}",
        "dtype": MEMORY_DTYPE,
        "budget": {"what": "one H200's pool budget (notebook 08): 0.9 x 139.8 GiB less the weights", "bytes": budget},
        "ledgers": ledgers,
    }


# ------------------------------------------------------------------------------------------------------- the report


def print_decode(part: dict, title: str) -> None:
    print(f"\n{title}: decode tokens/s (tokens per step / median step, systems taking turns)")
    print(f"{'batch':>5} {'system':>18} {'accepted':>9} {'tokens/step':>12} {'tokens/s':>10} {'vs no spec':>11}")
    for row in part["decode"]:
        for name, result in row["systems"].items():
            accepted = "-" if name == NO_SPECULATION else f"{result['acceptance_rate']:.0%}"
            print(
                f"{row['batch']:>5} {name:>18} {accepted:>9} {result['tokens_per_decode_step']:>12.2f} "
                f"{result['tokens_per_s']:>10.2f} {row['speedup'][name]:>10.2f}x"
            )


def print_mtp(mtp: dict, threads: int, new_tokens: int) -> None:
    print(
        f"MTP drafts, {mtp['shapes']} ({mtp['checkpoint']}), {mtp['dtype']}, {threads} threads: "
        f"{mtp['held_out_prompts']} held-out prompts x {new_tokens} tokens"
    )
    print(f"{'k':>3} {'acceptance':>11} {'tokens/step':>12}")
    for k, a in mtp["acceptance"].items():
        print(f"{k:>3} {a['acceptance_rate']:>11.1%} {a['tokens_per_decode_step']:>12.2f}")
    print_decode(mtp, f"MTP drafts, {mtp['shapes']}")


def print_oracle(oracle: dict) -> None:
    title = f"oracle drafts (acceptance forced) and MTP drafts, {oracle['shapes']} shapes, {oracle['dtype']}"
    print_decode(oracle, title)


def print_memory(memory: dict) -> None:
    budget = memory["budget"]["bytes"]
    print(
        f"\nverify states, {memory['shapes']}, {memory['dtype']} (engine.memory_plan.ledger); requests in one H200's "
        f"pool budget ({budget / 2**30:.1f} GiB)"
    )
    contexts = list(memory["ledgers"]["0"]["requests"])
    print(
        f"{'k':>3} {'state/slot':>12} {'verify/slot':>12} {'slot':>12} {'KV/token':>9} {'MTP share':>10}"
        + "".join(f"{'requests of ' + c:>19}" for c in contexts)
    )
    for k, ledger in memory["ledgers"].items():
        share = ledger["mtp_kv_bytes_per_token"] / ledger["kv_bytes_per_token"]
        print(
            f"{k:>3} {mib(ledger['state_bytes_per_slot']):>12} {mib(ledger['verify_bytes_per_slot']):>12} "
            f"{mib(ledger['bytes_per_slot']):>12} {ledger['kv_bytes_per_token']:>9,} {share:>10.0%}"
            + "".join(f"{ledger['requests'][c]:>19,}" for c in contexts)
        )


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def draw_decode(part: dict, ax, title: str) -> None:
    """Decode tokens/s of every system at each batch, labelled with its speed-up over no speculation."""
    names = list(part["decode"][0]["systems"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [b + (i - (len(names) - 1) / 2) * width for b in range(len(part["decode"]))]
        rates = [row["systems"][name]["tokens_per_s"] for row in part["decode"]]
        bars = ax.bar(xs, rates, width, label=name)
        ax.bar_label(bars, [f"{row['speedup'][name]:.2f}x" for row in part["decode"]], fontsize=7)
    ax.set_xticks(range(len(part["decode"])), [f"batch {row['batch']}" for row in part["decode"]])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, loc="left", fontsize=10)
    ax.legend(fontsize=7)


def draw(report: dict, axes) -> None:
    """The five panels: MTP acceptance of both checkpoints, MTP decode speed of each, oracle decode speed, memory
    per slot."""
    acceptance_ax, *mtp_axes, oracle_ax, memory_ax = axes
    width = 0.8 / len(MTP_PARTS)
    for i, key in enumerate(MTP_PARTS):
        mtp = report[key]
        ks = list(mtp["acceptance"])
        xs = [x + (i - (len(MTP_PARTS) - 1) / 2) * width for x in range(len(ks))]
        bars = acceptance_ax.bar(xs, [mtp["acceptance"][k]["acceptance_rate"] for k in ks], width, label=mtp["shapes"])
        acceptance_ax.bar_label(
            bars, [f"{mtp['acceptance'][k]['tokens_per_decode_step']:.2f}" for k in ks], fontsize=7
        )
        acceptance_ax.set_xticks(range(len(ks)), [f"k={k}" for k in ks])
    acceptance_ax.set_ylim(0, 1.1)
    acceptance_ax.set_ylabel("acceptance rate")
    acceptance_ax.set_title("MTP drafts: held-out prompts (labels: tokens per step)", loc="left", fontsize=10)
    acceptance_ax.legend(fontsize=7)
    for key, ax in zip(MTP_PARTS, mtp_axes):
        draw_decode(report[key], ax, f"MTP drafts, {report[key]['shapes']} (labels: vs no speculation)")
    oracle = report["oracle"]
    draw_decode(oracle, oracle_ax, f"oracle and MTP drafts, {oracle['shapes']} shapes (labels: vs no speculation)")

    memory = report["memory"]
    ledgers = memory["ledgers"]
    labels = [f"k={k}" for k in ledgers]
    bottom = [0.0] * len(ledgers)
    for key, label in (
        ("table_bytes_per_slot", "table row"),
        ("state_bytes_per_slot", "GDN states"),
        ("verify_bytes_per_slot", "verify states"),
    ):
        values = [ledger[key] / 2**20 for ledger in ledgers.values()]
        bars = memory_ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    context = list(ledgers["0"]["requests"])[0]
    memory_ax.bar_label(bars, [f"{ledger['requests'][context]:,} req." for ledger in ledgers.values()], fontsize=7)
    memory_ax.set_ylabel("MiB per request slot")
    memory_ax.set_title(
        f"a slot, {memory['shapes']}, {memory['dtype']} (labels: requests of {context} tokens per H200)",
        loc="left",
        fontsize=10,
    )
    memory_ax.legend(fontsize=7)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 12))
    draw(report, axes.flat[:5])
    axes.flat[5].axis("off")
    fig.suptitle(f"speculative decoding on CPU ({report['threads']} threads)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure, print each part's table as it is done, write spec.json and spec.png into out_dir (when given);
    returns the JSON."""
    start = time.perf_counter()
    workload = Workload.quick() if quick else Workload.full()
    threads = torch.get_num_threads()
    report = {
        "benchmark": "spec",
        "threads": threads,
        "workload": asdict(workload),
        "statistic": "decode tokens/s: tokens gained per decode step / the median decode step, over the runs after "
        "an untimed one, the systems of a part taking turns",
    }
    for key, checkpoint in MTP_PARTS.items():
        report[key] = mtp_part(workload, checkpoint)
        print_mtp(report[key], threads, workload.acceptance_new_tokens)
        gc.collect()  # each part's engines go before the next part's are built
    report["oracle"] = oracle_part(workload)
    print_oracle(report["oracle"])
    gc.collect()
    report["memory"] = memory_part(workload)
    print_memory(report["memory"])
    report["wall_seconds"] = time.perf_counter() - start
    if out_dir is not None:
        write_report(out_dir, "spec", report, plot)
    return report
