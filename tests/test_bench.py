"""The benchmarks of `python -m a4 bench` in their quick form: each runs and writes its JSON and figure.

Timings are never asserted (they depend on the machine); what is checked is that every figure the report needs is
there, and that the benchmark's switch to the recurrence still prefills correctly (tokens against transformers).
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import a4.__main__ as cli
import a4.layers.gdn_backend as gdn_backend
from a4 import LLM, SamplingParams
from a4._overlay import REPO_ROOT
from a4.bench import decode_context, engine, gpu, prefill, serve, spec
from a4.checkpoints import make_checkpoint
from a4.course.checks.memory import figures
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
    chunked = gdn_backend.chunk_gated_delta_rule
    llm = LLM(tiny_qwen3_5, max_prefill_tokens=64)
    with prefill.recurrence_in_prefill():
        assert gdn_backend.chunk_gated_delta_rule is prefill.recurrent_prefill
        outputs = llm.generate(prompts, SamplingParams(max_new_tokens=4))
    assert gdn_backend.chunk_gated_delta_rule is chunked
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5, prompts, 4)


def test_engine_writes_both_dtypes(tmp_path):
    engine.main(quick=True, out_dir=tmp_path)
    report = read_outputs(tmp_path, "engine")
    assert list(report["results"]) == list(engine.DTYPES)
    for result in report["results"].values():
        for system in engine.SYSTEMS:
            assert set(result["tokens_per_s"][system]) == set(engine.WORKLOADS)
        assert result["floor"]["gemm_flop_per_s"] > 0 and result["floor"]["copy_bytes_per_s"] > 0
        for system in engine.SYSTEMS:
            assert set(result["fraction_of_floor"][system]) == set(engine.WORKLOADS)
            assert all(f > 0 for f in result["fraction_of_floor"][system].values())
        memory = result["memory"]
        # The pools the engine allocated are real tensors: the process's peak memory holds at least them.
        assert memory["peak_rss_above_baseline"] >= memory["pools_allocated"] > 0
        assert memory["weights"] > 0


def test_engine_prompts_avoid_stop_tokens():
    prompts = engine.random_prompts((50, 7), vocab_size=20, stop_tokens=(3, 4), seed=0)
    assert [len(p) for p in prompts] == [50, 7]
    assert all(0 <= token < 20 and token not in (3, 4) for p in prompts for token in p)


def test_decode_steps_are_timed_only_at_the_whole_batch():
    """A decode step timed as batch b's decodes every unfinished request of the b: an engine with fewer slots than
    the batch decodes part of it while the rest waits, and is refused instead of timed."""
    model_dir = make_checkpoint(None, "qwen3_5", preset="tiny")
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3]
    # By hand: each request's first token comes from its prefill, so 6 new tokens are 5 decode steps of both.
    runner = engine.A4Runner(model_dir, "float32", max_prefill_tokens=64, max_running_requests=2)
    assert len(runner.decode_step_seconds(prompts, 6)) == 5
    one_slot = engine.A4Runner(model_dir, "float32", max_prefill_tokens=64, max_running_requests=1)
    with pytest.raises(RuntimeError, match=r"ran 1 of the 2 unfinished requests .* 1 request slots"):
        one_slot.decode_step_seconds(prompts, 6)
    assert not one_slot.llm.engine.has_unfinished_requests  # both aborted: the engine is left idle
    assert len(one_slot.decode_step_seconds(prompts[:1], 6)) == 5


def test_engine_fraction_of_floor_arithmetic():
    workload = engine.Workload(100, 10, (10, 30), new_tokens=4, repeats=1, copy_bytes=1)
    floor = {
        "gemm_flop_per_s": 1e9, "copy_bytes_per_s": 1e9, "weight_bytes": 10**6, "non_embedding_params": 10**5,
        "state_bytes_per_request": 1000, "kv_bytes_per_token": 10, "routed_expert_params": 0, "num_experts": 0,
        "experts_per_token": 0, "bytes_per_param": 4,
    }  # fmt: skip
    # By hand: prefill 2 * 1e5 * 100 FLOP = 20 ms at the GEMM rate, measured 40 ms. Decode batch 1 reads the weights
    # and the KV, reads the state and writes it back: 1e6 + 2 * 1000 + 10 * (10 + 4 / 2) bytes = 1.00212 ms at the
    # bandwidth, measured 4x that; batch 2 (prompts of 10 and 30, mean context 20 + 2) moves 1e6 + 2 * (2 * 1000 +
    # 220) bytes = 1.00444 ms, measured 2x that.
    tokens_per_s = {"prefill": 100 / 0.040, "decode batch 1": 1 / 4.00848e-3, "decode batch 8": 2 / 2.00888e-3}
    fractions = engine.fraction_of_floor(tokens_per_s, floor, workload)
    assert fractions == pytest.approx({"prefill": 0.5, "decode batch 1": 0.25, "decode batch 8": 0.5})


def test_moe_floor_counts_only_the_chosen_experts():
    from a4.bench._floor import ModelBytes

    model = ModelBytes(weight_bytes=10**9, non_embedding_params=4 * 10**8, state_bytes_per_request=0,
                       kv_bytes_per_token=0, routed_expert_params=2 * 10**8, num_experts=4, experts_per_token=1,
                       bytes_per_param=4)  # fmt: skip
    # By hand: the experts are 8e8 of the 1e9 bytes. One token reads 1 of the 4 experts (2e8 bytes) besides the 2e8
    # of other weights; two tokens leave each expert unread with probability (3/4)^2, so read 8e8 * 7/16 = 3.5e8.
    assert model.decode_bytes(1, context=0) == pytest.approx(4e8)
    assert model.decode_bytes(2, context=0) == pytest.approx(5.5e8)
    # A prefill token multiplies 2e8 non-expert parameters and a quarter of the 2e8 expert ones: 2 * 2.5e8 FLOP.
    assert model.prefill_flop(10) == pytest.approx(10 * 2 * 2.5e8)
    dense = ModelBytes(10**9, 4 * 10**8, 0, 0, routed_expert_params=0, num_experts=0, experts_per_token=0,
                       bytes_per_param=2)  # fmt: skip
    assert dense.decode_bytes(2, context=0) == 10**9 and dense.prefill_flop(10) == 10 * 2 * 4e8


def test_floors_leave_out_an_untied_embedding_and_take_the_longer_of_flop_and_bytes():
    from a4.bench._floor import ModelBytes

    # 1e9 bytes of weights, of which an untied embedding 1e8 (a decode step reads a row per token of it) and routed
    # experts 8e8 (4 experts, 1 per token).
    model = ModelBytes(weight_bytes=10**9, non_embedding_params=4 * 10**8, state_bytes_per_request=0,
                       kv_bytes_per_token=0, routed_expert_params=2 * 10**8, num_experts=4, experts_per_token=1,
                       bytes_per_param=4, untied_embedding_bytes=10**8)  # fmt: skip
    # By hand: one token reads 1e9 - 1e8 - 3/4 * 8e8 = 3e8 bytes.
    assert model.decode_bytes(1, context=0) == pytest.approx(3e8)
    # A prefill of 10 tokens: 10 * 2 * 2.5e8 = 5e9 FLOP, 5 s at 1e9 FLOP/s but 0.05 s at 1e11; its 10 tokens leave
    # each expert unread with probability (3/4)^10, so it reads 1e9 - 1e8 - 8e8 * 0.75^10 bytes: at 1e9 B/s, ~0.855 s.
    read = (10**9 - 10**8 - 8e8 * 0.75**10) / 1e9
    assert model.prefill_floor_seconds(10, flop_per_s=1e9, bytes_per_s=1e9) == pytest.approx(5.0)
    assert model.prefill_floor_seconds(10, flop_per_s=1e11, bytes_per_s=1e9) == pytest.approx(read)
    # Reports written before the field: ModelBytes.from_dict takes it as 0.
    fields = {name: getattr(model, name) for name in ModelBytes.__dataclass_fields__} | {"unrelated": 1}
    assert ModelBytes.from_dict(fields) == model
    del fields["untied_embedding_bytes"]
    assert ModelBytes.from_dict(fields).untied_embedding_bytes == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_model_bytes_knows_a_tied_embedding_from_an_untied_one(arch):
    from a4.bench._floor import ModelBytes
    from a4.checkpoints import tiny_checkpoint
    from a4.models.registry import load_model

    config, model, _ = load_model(tiny_checkpoint(arch), dtype=torch.float32, device="cpu", progress=False)
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embedding
    assert tied == config.tie_word_embeddings  # the tiny Qwen3's is untied, the tiny Qwen3.5's tied
    model_bytes = ModelBytes.of(model, config, torch.float32)
    assert model_bytes.weight_bytes == sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    assert model_bytes.untied_embedding_bytes == (0 if tied else embedding.nbytes)


def test_spec_report_is_complete_and_consistent(tmp_path, capsys):
    spec.main(quick=True, out_dir=tmp_path)
    printed = capsys.readouterr().out
    report = read_outputs(tmp_path, "spec")
    workload = spec.Workload.quick()

    # The MTP's acceptance on the held-out prompts: each request decodes all its tokens but the prefill's, gaining
    # its accepted drafts plus the model's own token per step.
    # Both tiny checkpoints: the random one and the trained one.
    for key in spec.MTP_PARTS:
        acceptance = report[key]["acceptance"]
        assert list(acceptance) == [str(k) for k in spec.SPECULATIVE_TOKENS]
        for k, a in acceptance.items():
            assert a["decode_tokens"] == len(workload.acceptance_lens) * (workload.acceptance_new_tokens - 1)
            assert a["decode_tokens"] == a["decode_request_steps"] + a["accepted_draft_tokens"]
            assert 0 <= a["acceptance_rate"] == a["accepted_draft_tokens"] / a["draft_tokens"] <= 1
            assert 1 <= a["tokens_per_decode_step"] <= int(k) + 1

    mtp_systems = [spec.NO_SPECULATION] + [f"k={k}" for k in spec.SPECULATIVE_TOKENS]
    oracle_systems = [spec.NO_SPECULATION, *spec.ORACLE_SYSTEMS, spec.MTP_SYSTEM]
    parts = ((report["mtp"], mtp_systems, workload.mtp_new_tokens),
             (report["mtp_trained"], mtp_systems, workload.mtp_new_tokens),
             (report["oracle"], oracle_systems, workload.oracle_new_tokens))  # fmt: skip
    for part, names, new_tokens in parts:
        assert [row["batch"] for row in part["decode"]] == list(spec.BATCHES)
        for row in part["decode"]:
            assert list(row["systems"]) == names
            for name, result in row["systems"].items():
                runs = result["runs"]
                assert len(runs) == workload.repeats
                assert all(run["decode_tokens"] == row["batch"] * (new_tokens - 1) for run in runs)
                assert all(len(run["decode_step_seconds"]) == run["decode_steps"] for run in runs)
                tokens_per_step = sum(run["decode_tokens"] for run in runs) / sum(run["decode_steps"] for run in runs)
                step_seconds = statistics.median(s for run in runs for s in run["decode_step_seconds"])
                assert result["tokens_per_s"] == pytest.approx(tokens_per_step / step_seconds) and step_seconds > 0
                # The speed-up is the ratio of the two rates measured side by side.
                base = row["systems"][spec.NO_SPECULATION]["tokens_per_s"]
                assert row["speedup"][name] == pytest.approx(result["tokens_per_s"] / base)
                assert 0 <= result["acceptance_rate"] <= 1 and result["tokens_per_decode_step"] >= 1
                assert f"{name:>18}" in printed
            assert row["systems"][spec.NO_SPECULATION]["tokens_per_decode_step"] == 1

    # The oracle forces its acceptance: wrong drafts are never accepted, right ones always (a request's last drafts
    # are shorter, all right with 1 of 2 right: at least half accepted then).
    for row in report["oracle"]["decode"]:
        wrong, half, right = (row["systems"][name] for name in spec.ORACLE_SYSTEMS)
        assert wrong["acceptance_rate"] == 0 and wrong["tokens_per_decode_step"] == 1
        assert 0.5 <= half["acceptance_rate"] < 1
        assert right["acceptance_rate"] == 1 and right["tokens_per_decode_step"] > half["tokens_per_decode_step"]

    # The ledgers, against config.json's arithmetic: k + 1 GDN states per slot for the verify pass, and one more
    # attention layer's KV (the MTP module's) per token; the requests that fit are the budget over their bytes.
    memory = report["memory"]
    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset)
    config = json.loads((model_dir / "config.json").read_text())
    fig = figures(config, torch.bfloat16)
    text = config["text_config"]
    mtp_kv_bytes_per_token = 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    assert list(memory["ledgers"]) == ["0"] + [str(k) for k in spec.SPECULATIVE_TOKENS]
    for k, ledger in memory["ledgers"].items():
        k = int(k)
        assert ledger["state_bytes_per_slot"] == fig.state_bytes_per_slot
        assert ledger["verify_bytes_per_slot"] == ((k + 1) * fig.state_bytes_per_slot if k else 0)
        assert ledger["bytes_per_slot"] == fig.slot_bytes + ledger["verify_bytes_per_slot"]
        assert ledger["mtp_kv_bytes_per_token"] == (mtp_kv_bytes_per_token if k else 0)
        assert ledger["kv_bytes_per_token"] == fig.kv_bytes_per_token + ledger["mtp_kv_bytes_per_token"]
        assert ledger["mtp_weight_bytes"] == (2 * mtp_parameters(model_dir) if k else 0)
        for context, requests in ledger["requests"].items():
            cost = ledger["bytes_per_slot"] + int(context) * ledger["kv_bytes_per_token"]
            assert requests == (memory["budget"]["bytes"] - ledger["mtp_weight_bytes"]) // cost


def mtp_parameters(model_dir) -> int:
    """Values of the checkpoint's `mtp.*` tensors, read from its safetensors files."""
    from safetensors import safe_open

    count = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            count += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys() if key.startswith("mtp."))
    return count


GPU_WORKLOAD = gpu.Workload(
    "0.8b", (512, 2048), (1, 8), prompt_len=100, decode_steps=20, prefill_repeats=1, contexts=(1024, 4096),
    repeats=1, copy_bytes=1, gemm_size=1,
)  # fmt: skip


def synthetic_gpu_parts() -> dict:
    """Round figures: a4 at twice each floor, transformers at four times."""
    floor = {
        "device": "NVIDIA H200", "hbm_bytes_per_s": 1e12, "bf16_flop_per_s": 1e14, "weight_bytes": 10**9,
        "non_embedding_params": 5 * 10**8, "state_bytes_per_request": 10**6, "kv_bytes_per_token": 1000,
        "routed_expert_params": 0, "num_experts": 0, "experts_per_token": 0, "bytes_per_param": 2,
    }  # fmt: skip
    # By hand: decode moves 1e9 + batch * (2 * 1e6 + 1000 * (100 + 20 / 2)) bytes (each state read and written) at
    # 1e12 B/s: 1.00211 ms at batch 1, 1.01688 ms at batch 8; prefill 2 * 5e8 * tokens FLOP at 1e14 FLOP/s: 5.12 ms
    # for 512 tokens, 20.48 ms for 2048.
    a4 = {"prefill_ms": {"512": 10.24, "2048": 40.96}, "decode_ms": {"1": 2.00422, "8": 2.03376}}
    return {
        "floor": floor,
        "a4": {**a4, "launch_profile": [
            {"step": "prefill", "batch": 1, "tokens": 2048, "kernels": 900, "kernel_ms": 30.0, "wall_ms": 40.96},
            {"step": "decode", "batch": 8, "tokens": 8, "kernels": 100, "kernel_ms": 1.0, "wall_ms": 2.03376},
        ]},  # fmt: skip
        "transformers": {kind: {key: 2 * ms for key, ms in times.items()} for kind, times in a4.items()},
        "context": {"gdn_layer_ms": [0.1, 0.1], "attention_layer_ms": [0.1, 0.3], "step_ms": [2.0, 2.2]},
    }


def test_gpu_report_floors_ratios_and_schema(tmp_path, capsys):
    report = gpu.assemble(synthetic_gpu_parts(), GPU_WORKLOAD, gpu.meta("NVIDIA H200", GPU_WORKLOAD, False, "abc1234"))
    # The schema notebook 10 reads (contracts of issue 12): exactly these keys.
    assert set(report) == {"meta", "floor", "systems", "decode_vs_context", "launch_profile"}
    assert set(report["meta"]) == {
        "device", "torch", "triton", "transformers", "fla", "dtype", "shapes", "date", "commit"
    }  # fmt: skip
    assert report["meta"]["dtype"] == "bfloat16" and report["meta"]["shapes"] == "0.8b"
    floor = report["floor"]
    assert set(floor) == {"hbm_bytes_per_s", "bf16_flop_per_s", "weight_bytes", "decode_floor_ms", "prefill_floor_ms"}
    assert floor["decode_floor_ms"] == pytest.approx({"1": 1.00211, "8": 1.01688})
    assert floor["prefill_floor_ms"] == pytest.approx({"512": 5.12, "2048": 20.48})
    assert set(report["systems"]) == {"a4", "transformers"}
    assert all(set(times) == {"prefill_ms", "decode_ms"} for times in report["systems"].values())
    assert report["decode_vs_context"] == {
        "context": [1024, 4096], "batch": 1, "gdn_layer_ms": [0.1, 0.1], "attention_layer_ms": [0.1, 0.3],
        "step_ms": [2.0, 2.2],
    }  # fmt: skip
    # Each step profile beside its step's floor (by hand, above).
    assert report["launch_profile"] == [
        {"system": "a4", "step": "prefill", "batch": 1, "tokens": 2048, "kernels": 900, "kernel_ms": 30.0,
         "wall_ms": 40.96, "floor_ms": pytest.approx(20.48)},
        {"system": "a4", "step": "decode", "batch": 8, "tokens": 8, "kernels": 100, "kernel_ms": 1.0,
         "wall_ms": 2.03376, "floor_ms": pytest.approx(1.01688)},
    ]  # fmt: skip
    json.dumps(report)  # all of it JSON

    labels = ["prefill 512 tokens", "prefill 2048 tokens", "decode batch 1", "decode batch 8"]
    assert gpu.speedups(report) == {"transformers": pytest.approx(dict.fromkeys(labels, 2.0))}
    fractions = gpu.floor_fractions(report)
    assert fractions["a4"] == pytest.approx(dict.fromkeys(labels, 0.5))
    assert fractions["transformers"] == pytest.approx(dict.fromkeys(labels, 0.25))

    gpu.print_table(report)
    printed = capsys.readouterr().out
    assert "50.0%" in printed and "25.0%" in printed and "2.00" in printed
    assert "prefill 2048 tokens: 900 GPU kernels running 30.00 ms" in printed
    assert "decode batch 8: 100 GPU kernels running 1.00 ms of a 2.03 ms step (49%" in printed
    gpu.plot(report, tmp_path / "gpu.png")
    assert (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.parametrize("overlap_schedule", [False, True])
def test_step_profiles_profile_the_steps_they_name(overlap_schedule):
    """bench gpu's launch profiles drive the engine to the step each names (a prefill of one prompt, a decode step of
    the whole batch after chunked prefills) and profile that one step (under overlap scheduling, the call that
    launches it); the requests then finish, and the engine is left idle for the next profile."""
    model_dir = make_checkpoint(None, "qwen3_5", preset="tiny")
    # max_prefill_tokens 24: the batch of 3 x 16 prompt tokens prefills over more than one step.
    runner = engine.A4Runner(model_dir, "float32", max_prefill_tokens=24, max_running_requests=3,
                             overlap_schedule=overlap_schedule)  # fmt: skip
    prompts = [[5 + i, 6, 7, 8] * 4 for i in range(4)]
    times = {"prefill_ms": {"16": 1.5}, "decode_ms": {"1": 0.5, "3": 0.7}}
    profiles = gpu.step_profiles(runner.llm.engine, prompts[:1], prompts[1:], (1, 3), times)
    assert [(p["step"], p["batch"], p["tokens"], p["wall_ms"]) for p in profiles] == [
        ("prefill", 1, 16, 1.5), ("decode", 1, 1, 0.5), ("decode", 3, 3, 0.7)
    ]  # fmt: skip
    assert all(p["kernels"] == 0 and p["top_kernels"] == [] for p in profiles)  # no GPU here
    stats = runner.llm.engine.stats
    assert not runner.llm.engine.has_unfinished_requests
    # Every one of the 5 requests ran to its end: 1 token from its prefill, the others from decode steps.
    assert stats.decode_tokens == 5 * (gpu.PROFILE_NEW_TOKENS - 1)


def test_gpu_parts_run_on_the_cpu(capsys):
    """Every part of `bench gpu` but the processes and CUDA: the tiny model on the CPU, then the report."""
    workload = gpu.Workload.quick()
    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset)
    cpu = torch.device("cpu")
    # flash-linear-attention is never installed on a CPU (its absence is checked elsewhere).
    parts = {part: gpu.run_part(part, model_dir, workload, cpu) for part in gpu.PARTS if part != "transformers_fla"}
    report = gpu.assemble(parts, workload, gpu.meta("cpu", workload, False, "abc1234"))
    assert set(report["systems"]) == {"a4", "a4_no_graphs", "a4_no_overlap", "transformers"}
    for times in report["systems"].values():
        assert set(times["prefill_ms"]) == {str(n) for n in workload.prefill_lens}
        assert set(times["decode_ms"]) == {str(b) for b in workload.batches}
        assert min(times["prefill_ms"].values()) > 0 and min(times["decode_ms"].values()) > 0
    context = report["decode_vs_context"]
    assert all(len(context[key]) == len(workload.contexts) for key in ("gdn_layer_ms", "attention_layer_ms", "step_ms"))
    assert report["launch_profile"] == []  # profiled on CUDA only
    throughput = report["throughput"]
    assert throughput["requests"] == workload.throughput_requests and throughput["output_tokens"] > 0
    low, high = workload.throughput_lens
    # The default engine's figures, and those without overlap scheduling and with mixed steps: the same tokens.
    for variant in (throughput, throughput["no_overlap"], throughput["mixed"]):
        assert low * workload.throughput_requests <= variant["output_tokens"] <= high * workload.throughput_requests
        assert variant["output_tokens"] == throughput["output_tokens"]
        steps = variant["steps"]
        assert steps["prefill_steps"] > 0 and steps["decode_steps"] > 0
        assert 0 < steps["prefill_seconds"] + steps["decode_seconds"] <= variant["seconds"]
    assert throughput["steps"]["mixed_steps"] == 0 == throughput["no_overlap"]["steps"]["mixed_steps"]
    floor = report["floor"]
    assert floor["hbm_bytes_per_s"] > 0 and floor["bf16_flop_per_s"] > 0
    # The tiny model's bytes, independently: every parameter once, in bfloat16 (2 bytes).
    assert floor["weight_bytes"] == 2 * hf_text_model_parameters(model_dir)

    speculative = report["speculative"]
    k = workload.spec_tokens
    assert [row["batch"] for row in speculative["decode"]] == list(workload.spec_batches)
    for row in speculative["decode"]:
        assert list(row["systems"]) == [spec.NO_SPECULATION, f"k={k}, {k}/{k} right", f"k={k}, 0/{k} right"]
        for name, result in row["systems"].items():
            drafts_right = name.endswith(f"{k}/{k} right")
            # Oracle drafts from the plain run's own greedy tokens (bfloat16 on the CPU, where the verify pass
            # computes what the decode step does): all right means all accepted, none right none.
            if name != spec.NO_SPECULATION:
                assert result["acceptance_rate"] == (1.0 if drafts_right else 0.0)
            assert (result["tokens_per_decode_step"] > 1) == drafts_right
            assert result["tokens_per_s"] > 0

    moe = report["moe"]
    assert moe["preset"] == workload.moe_preset and moe["launch_profile"] == []  # profiled on CUDA only
    assert set(moe["decode_ms"]) == set(moe["decode_floor_ms"]) == {str(b) for b in workload.moe_batches}
    assert set(moe["prefill_ms"]) == {str(n) for n in workload.prefill_lens}
    # The weights were drawn on the device, not read: the MoE model's bytes, independently, from transformers.
    moe_dir = make_checkpoint(None, "qwen3_5_moe", preset=workload.moe_preset)
    assert moe["weight_bytes"] == 2 * hf_text_model_parameters(moe_dir)

    # Speculation at the MoE's shapes, batch 1: plain decode, then per k oracle drafts all right and none right, and
    # the model's own MTP drafts; each a decode run of spec_new_tokens whose figures add up as bench spec's do.
    moe_spec = report["moe_speculative"]
    assert moe_spec["preset"] == workload.moe_preset
    [row] = moe_spec["decode"]
    ks = workload.moe_spec_tokens
    all_right = {f"k={k}, {right}/{k} right": right == k for k in ks for right in (k, 0)}  # oracle -> drafts all right
    names = [spec.NO_SPECULATION] + [name for k in ks for name in (f"k={k}, {k}/{k} right", f"k={k}, 0/{k} right",
                                                                   f"k={k}, MTP drafts")]  # fmt: skip
    assert row["batch"] == 1 and list(row["systems"]) == names
    base = row["systems"][spec.NO_SPECULATION]["tokens_per_s"]
    for name, result in row["systems"].items():
        runs = result["runs"]
        assert len(runs) == workload.spec_repeats
        assert all(run["decode_tokens"] == workload.spec_new_tokens - 1 for run in runs)
        tokens_per_step = sum(run["decode_tokens"] for run in runs) / sum(run["decode_steps"] for run in runs)
        step_seconds = statistics.median(s for run in runs for s in run["decode_step_seconds"])
        assert result["tokens_per_s"] == pytest.approx(tokens_per_step / step_seconds) and step_seconds > 0
        assert row["speedup"][name] == pytest.approx(result["tokens_per_s"] / base)
        assert 0 <= result["acceptance_rate"] <= 1
        if name in all_right:
            # The oracle's drafts are the plain engine's own greedy tokens (bfloat16 on the CPU, where the verify
            # pass computes what the decode step does): all right means all accepted; none right, none.
            assert result["acceptance_rate"] == (1.0 if all_right[name] else 0.0), name
            assert (result["tokens_per_decode_step"] > 1) == all_right[name], name
    gpu.print_table(report)
    printed = capsys.readouterr().out
    assert f"speculative decoding at Qwen3.5-MoE-{workload.moe_preset} shapes" in printed
    assert all(f"{name:>18}" in printed for name in names)


def test_gpu_context_part_times_the_engines_graph_safe_decode(monkeypatch):
    # The engine's captured decode step updates the GDN states by slot (notebook 10's step, Triton's on CUDA);
    # notebook 04's eager decode gathers and scatters through host-built tensors, which a CUDA graph cannot capture:
    # timed eagerly, it measured Python, not the GPU.
    from a4.layers import gdn_backend

    def notebook_04_decode(*args, **kwargs):
        raise AssertionError("the context part ran notebook 04's eager decode, not the engine's graph-safe one")

    monkeypatch.setattr(gdn_backend, "causal_conv1d_decode", notebook_04_decode)
    monkeypatch.setattr(gdn_backend, "recurrent_gated_delta_rule", notebook_04_decode)
    workload = gpu.Workload.quick()
    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset)
    result = gpu.run_part("context", model_dir, workload, torch.device("cpu"))
    assert {key: len(times) for key, times in result.items()} == dict.fromkeys(
        ("gdn_layer_ms", "attention_layer_ms", "step_ms"), len(workload.contexts)
    )


def hf_text_model_parameters(model_dir) -> int:
    """The parameters of transformers' text model of the checkpoint (a tied embedding counted once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_gpu_parts_dir_runs_only_the_parts_not_yet_measured(tmp_path, monkeypatch):
    # A run cut short kept its parts' JSON: the next one runs only what is missing, each part in its own process.
    monkeypatch.setattr(gpu, "installed_version", lambda distributions: None)  # no fla: no transformers_fla part
    for part in gpu.PARTS:
        if part not in ("transformers_fla", "moe"):
            (tmp_path / f"{part}.json").write_text(json.dumps({"part": part}))
    commands = []

    def run(command):
        commands.append(command)
        folder = Path(command[command.index("--out") + 1])
        (folder / f"{command[command.index('--system') + 1]}.json").write_text(json.dumps({"part": "moe, now"}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(gpu.subprocess, "run", run)
    parts = gpu.run_parts(quick=True, parts_dir=tmp_path)
    assert [command[command.index("--system") + 1] for command in commands] == ["moe"]
    assert commands[0][-1] == "--quick" and Path(commands[0][commands[0].index("--out") + 1]) == tmp_path
    assert parts == {part: {"part": part} for part in gpu.PARTS if part not in ("transformers_fla", "moe")} | {
        "moe": {"part": "moe, now"}
    }


def test_gpu_part_option_belongs_to_bench_gpu(capsys):
    assert cli.main(["bench", "engine", "--system", "a4"]) == cli.USAGE_ERROR
    assert "--system" in capsys.readouterr().err


def test_bench_gpu_without_cuda_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "gpu"]) == 1  # asked for by name: a failure
    assert "needs an NVIDIA GPU with CUDA" in capsys.readouterr().err
    # Among all the benchmarks (`make bench` on a CPU), it is skipped and the others' status stands.
    monkeypatch.setattr(cli, "benchmark_names", lambda: ["gpu"])
    assert cli.main(["bench"]) == 0
    assert "bench gpu cannot run on this machine" in capsys.readouterr().out


def test_transformers_process_cannot_import_kernel_packages(tmp_path):
    # A stand-in flash-linear-attention on the path: importable, until blocked.
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    script = """
import importlib.util
from a4.bench import gpu

assert importlib.util.find_spec("fla") is not None and not gpu.kernel_package_imported("fla")
gpu.block_kernel_packages()
assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
try:
    import fla
except ImportError:
    pass
else:
    raise SystemExit("fla was imported")
assert not gpu.kernel_package_imported("fla")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    imported = "import fla\nfrom a4.bench import gpu\nassert gpu.kernel_package_imported('fla')"
    assert subprocess.run([sys.executable, "-c", imported], env=env).returncode == 0


def test_serve_measures_every_rate_and_the_multi_turn_chat(chat_model_dir, tmp_path):
    serve.main(quick=True, out_dir=tmp_path, model_dir=chat_model_dir)
    report = read_outputs(tmp_path, "serve")
    workload = serve.Workload.quick()
    assert [row["rate"] for row in report["rates"]] == list(workload.rates)
    for row in [*report["rates"], report["multi_turn"]]:
        assert row["completed"] > 0 and row["failed"] == 0, row["errors"]
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert list(row[key]) == [f"p{p}" for p in serve.PERCENTILES]
        assert row["request_throughput"] > 0 and row["output_token_throughput"] > 0
    # Every request generated max_tokens (ignore_eos), and only the chat's later turns find a cached prefix.
    assert report["rates"][0]["output_token_throughput"] * report["rates"][0]["duration_s"] == pytest.approx(
        report["rates"][0]["completed"] * workload.max_tokens
    )
    first_turn, *later_turns = report["multi_turn"]["cache_hit_rate_by_turn"]
    assert all(rate > 0 for rate in later_turns)
    # The rates again on a server with mixed steps the other way round: the same arrivals, every request served.
    mixed = report["mixed_chunk"]
    assert report["rates"] in (mixed["on"], mixed["off"]) and mixed["on"] != mixed["off"]
    for on, off in zip(mixed["on"], mixed["off"]):
        assert on["rate"] == off["rate"] and on["sent"] == off["sent"]
        assert on["failed"] == off["failed"] == 0


def test_serve_summary_arithmetic():
    results = [
        serve.RequestResult(True, ttft=0.1, itl=[0.01, 0.03], latency=0.2, prompt_tokens=10, completion_tokens=3),
        serve.RequestResult(True, ttft=0.3, itl=[0.02], latency=0.4, prompt_tokens=30, completion_tokens=2,
                            cached_tokens=20),
        serve.RequestResult(False, "HTTP 503"),
    ]  # fmt: skip
    summary = serve.summarize(results, duration=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, ["HTTP 503"])
    assert summary["request_throughput"] == 1.0 and summary["output_token_throughput"] == 2.5
    assert summary["total_token_throughput"] == 22.5 and summary["cache_hit_rate"] == 0.5
    assert summary["ttft_ms"]["p50"] == pytest.approx(200) and summary["itl_ms"]["p50"] == pytest.approx(20)


def test_serve_options_belong_to_bench_serve(capsys):
    assert cli.main(["bench", "engine", "--base-url", "http://127.0.0.1:1"]) == cli.USAGE_ERROR
    assert "--base-url is an option of bench serve only" in capsys.readouterr().err
    assert cli.main(["bench", "engine", "--commit", "abc1234"]) == cli.USAGE_ERROR
    assert "--commit is an option of bench gpu only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "gpu", "--commit", ""])
    assert "expected a commit's hash" in capsys.readouterr().err


def test_the_gpu_reports_commit_says_when_the_tree_is_not_that_commit(tmp_path):
    """A copy of the tree on another machine may carry an older .git: the report must not pass its HEAD off as the
    code that ran."""

    def git(*args):
        command = ["git", "-c", "user.name=a4", "-c", "user.email=a4@example.invalid", *args]
        return subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    assert gpu.tree_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked files are not the measured code\n")
    assert gpu.tree_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert gpu.tree_commit(tmp_path) == f"{head}+changes"


def test_bench_gpu_names_the_commit_it_is_given(tmp_path, monkeypatch):
    """`--commit`: the submitting side knows which commit it sent; the report names that one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "run_parts", lambda quick, parts_dir: synthetic_gpu_parts())
    monkeypatch.setattr(gpu.Workload, "full", staticmethod(lambda: GPU_WORKLOAD))
    assert cli.main(["bench", "gpu", "--commit", "abc1234", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "h200_gpu.json").read_text())
    assert report["meta"]["commit"] == "abc1234"
