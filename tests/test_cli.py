"""The command line: the demo end to end (a subprocess, as a user runs it), generate, bench dispatch, bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from a4.__main__ import chat_text, load_tokenizer, main
from a4.checkpoints import tiny_checkpoint
from a4.reference import hf_greedy

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # One intra-op thread: the suite runs two pytest workers on two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "a4", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_demo_runs_and_every_request_matches_transformers():
    result = run_cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) >= 6 and all(row[-1] == "yes" for row in rows)
    assert any(int(row[2]) > 0 for row in rows), "no request was served from the prefix cache"
    assert "all 8 requests match transformers" in result.stdout
    assert "KV per token" in result.stdout and "tok/s" in result.stdout


def test_generate_prints_the_greedy_continuation(capsys):
    ckpt = tiny_checkpoint("qwen3")
    assert main(["generate", "--model-dir", str(ckpt), "--prompt", "5 6 7", "--max-new-tokens", "4"]) == 0
    [expected] = hf_greedy(ckpt, [[5, 6, 7]], 4)
    assert capsys.readouterr().out.split("(")[0].split()[1:] == [str(t) for t in expected]


def test_missing_model_dir_is_one_line_and_exit_2():
    result = run_cli("generate", "--model-dir", "/no/such/checkpoint", "--prompt", "1 2")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --model-dir /no/such/checkpoint: no such directory"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required"),
        (["demo", "--arch", "llama"], "invalid choice"),
        (["demo", "--max-prefill-tokens", "0"], "positive integer"),
        (["generate", "--model-dir", ".", "--prompt", "1 two"], "token ids"),
        (["generate", "--model-dir", "."], "one of the arguments --prompt --text is required"),
        (["demo", "--dtype", "float64"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_text_without_a_tokenizer_is_a_clear_error(capsys):
    ckpt = tiny_checkpoint("qwen3")
    assert main(["generate", "--model-dir", str(ckpt), "--text", "hello"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err


def test_generate_chats_with_the_trained_checkpoint_by_default(capsys):
    assert main(["generate", "--chat", "--text", "What is 3 plus 4?", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    # The answer's text, from transformers' greedy tokens, must be what a4 printed.
    tokenizer = load_tokenizer(tiny_checkpoint("qwen3_5", trained=True))
    prompt = tokenizer.encode(chat_text(tokenizer, "What is 3 plus 4?"))
    [expected] = hf_greedy(tiny_checkpoint("qwen3_5", trained=True), [prompt], 12)
    assert f"-> {tokenizer.decode(expected)!r}" in out and "(eos)" in out


def test_chat_without_text_is_a_clear_error(capsys):
    assert main(["generate", "--chat", "--prompt", "1 2"]) == 2
    assert "--chat applies to --text" in capsys.readouterr().err


def test_bench_dispatches_to_the_named_module(monkeypatch, tmp_path, capsys):
    calls = []
    fake = types.ModuleType("a4.bench.fake")
    fake.main = lambda quick, out_dir: calls.append((quick, out_dir))
    monkeypatch.setitem(sys.modules, "a4.bench.fake", fake)
    monkeypatch.setattr("a4.__main__.benchmark_names", lambda: ["fake"])
    assert main(["bench", "fake", "--quick", "--out", str(tmp_path)]) == 0
    assert calls == [(True, tmp_path)]
    assert main(["bench", "nosuch"]) == 2
    assert "unknown benchmark 'nosuch' (available: fake)" in capsys.readouterr().err


def test_serve_has_a_flag_for_every_engine_option(capsys):
    from a4.llm import OPTIONS

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = capsys.readouterr().out
    assert all(f"--{name.replace('_', '-')}" in usage for name in OPTIONS), usage


def test_serve_checks_its_options_before_serving(chat_model_dir, capsys):
    assert main(["serve", "--model-dir", str(chat_model_dir), "--state-fraction", "2"]) == 2
    assert "state_fraction" in capsys.readouterr().err
