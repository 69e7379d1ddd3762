"""The benchmarks of `python -m a4 bench` in their quick form: each runs and writes its JSON and figure.

Timings are never asserted (they depend on the machine); what is checked is that every figure the report needs is
there, and that the benchmark's switch to the recurrence still prefills correctly (tokens against transformers).
"""

import json

import a4.layers.deltanet as deltanet
from a4 import LLM, SamplingParams
from a4.bench import decode_context, engine, prefill
from a4.reference import hf_greedy


def read_outputs(out_dir, name):
    assert (out_dir / f"{name}.png").stat().st_size > 0
    return json.loads((out_dir / f"{name}.json").read_text())


def test_decode_context_writes_both_parts(tmp_path):
    decode_context.main(quick=True, out_dir=tmp_path)
    report = read_outputs(tmp_path, "decode_context")
    for part, names in (("layers", decode_context.LAYERS), ("model", decode_context.MODELS)):
        contexts = report[part]["contexts"]
        assert contexts == list(decode_context.QUICK_CONTEXTS)
        assert set(report[part]["seconds"]) == set(names)
        assert all(len(s) == len(contexts) and min(s) > 0 for s in report[part]["seconds"].values())
        assert set(report[part]["slope_ms_per_1k_tokens"]) == set(names)


def test_slope_is_the_least_squares_line():
    # 2 ms at no context, plus 3 ms per 1k tokens: a line through the points gives back 3 ms per 1k.
    contexts = (0, 1000, 4000)
    assert abs(decode_context.slope_ms_per_1k(contexts, [0.002 + 3e-6 * n for n in contexts]) - 3.0) < 1e-9


def test_prefill_writes_both_forms(tmp_path):
    prefill.main(quick=True, out_dir=tmp_path)
    report = read_outputs(tmp_path, "prefill")
    assert [row["T"] for row in report["results"]] == list(prefill.QUICK_LENGTHS)
    for row in report["results"]:
        assert set(row["tokens_per_s"]) == set(prefill.FORMS)


def test_recurrence_in_prefill_matches_transformers_and_is_undone(tiny_qwen3_5):
    prompts = [[5, 17, 300, 42, 7] * 9, [11, 3]]  # a 45-token prompt spans chunks; batched with a short one
    chunked = deltanet.chunk_gated_delta_rule
    llm = LLM(tiny_qwen3_5, max_prefill_tokens=64)
    with prefill.recurrence_in_prefill():
        assert deltanet.chunk_gated_delta_rule is prefill.recurrent_prefill
        outputs = llm.generate(prompts, SamplingParams(max_new_tokens=4))
    assert deltanet.chunk_gated_delta_rule is chunked
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5, prompts, 4)


def test_engine_writes_both_dtypes(tmp_path):
    engine.main(quick=True, out_dir=tmp_path)
    report = read_outputs(tmp_path, "engine")
    assert list(report["results"]) == list(engine.DTYPES)
    for result in report["results"].values():
        for system in engine.SYSTEMS:
            assert set(result["tokens_per_s"][system]) == set(engine.WORKLOADS)
        memory = result["memory"]
        # The pools the engine allocated are real tensors: the process's peak memory holds at least them.
        assert memory["peak_rss_above_baseline"] >= memory["pools_allocated"] > 0
        assert memory["weights"] > 0


def test_engine_prompts_avoid_stop_tokens():
    prompts = engine.random_prompts((50, 7), vocab_size=20, stop_tokens=(3, 4), seed=0)
    assert [len(p) for p in prompts] == [50, 7]
    assert all(0 <= token < 20 and token not in (3, 4) for p in prompts for token in p)
