"""The clients people point at an OpenAI-compatible server, run as released against `python -m a4 serve` on the
trained tiny Qwen3.5 (`make client-test`; CI runs it):

- lm-evaluation-harness with its default `local-completions` options (token-id prompts, several per request with a
  batch size, `echo` + `logprobs` for log-likelihoods) on two closed-world tasks written in the harness's own task
  format (lm_eval_tasks/: multiple choice by log-likelihood, the capitals of a4/tiny_corpus.py's world; greedy
  generation until a stop string, its sums) scores what the same harness scores through its `hf` model type, which
  loads the same checkpoint in transformers: the same accuracy and exact match, each choice's log-likelihood within
  float32 rounding and the same greedy verdict, the same generated text.
- guidellm's streaming benchmarks of chat and text completions (synthetic prompts from the checkpoint's own tokenizer,
  a few requests) finish with every request successful.

The clients live in .venv-clients (tests/clients/requirements.txt), which only `make client-test` builds; they run as
commands, offline. Without it these tests are skipped, except under A4_REQUIRE_CLIENTS=1, which `make client-test`
sets, so that a missing client fails CI instead of passing unseen.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
from server_helpers import MODEL, REPO, launched_server

from a4.tiny_corpus import CAPITALS

CLIENTS_BIN = REPO / ".venv-clients" / "bin"
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ("tiny_world_capitals", "tiny_world_sums")
CLIENT_SECONDS = 600  # bound on one client run (about a minute each on 2 cores)
# Two float32 computations of a log-likelihood of a few tokens, one token at a time or a whole sequence at once.
LOGLIKELIHOOD_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def clients_bin() -> Path:
    missing = [name for name in ("lm_eval", "guidellm") if not (CLIENTS_BIN / name).exists()]
    if missing:
        message = f"{', '.join(missing)} not in {CLIENTS_BIN}: `make client-test` installs them"
        if os.environ.get("A4_REQUIRE_CLIENTS") == "1":
            pytest.fail(f"A4_REQUIRE_CLIENTS=1 but {message}", pytrace=False)
        pytest.skip(message)
    return CLIENTS_BIN


@pytest.fixture(scope="module")
def served(chat_model_dir, clients_bin):
    with launched_server(chat_model_dir) as server:
        yield server
        server.process.terminate()
        server.process.wait(60)


def run_client(command: list[str], tmp_path: Path, cwd: Path | None = None) -> str:
    """Run a client command offline (its caches under tmp_path); its output, or the test fails with it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    result = subprocess.run(command, cwd=cwd or tmp_path, env=env, capture_output=True, text=True,
                            timeout=CLIENT_SECONDS)  # fmt: skip
    assert result.returncode == 0, f"{command[0]} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def test_the_task_data_is_the_tiny_corpus_world():
    rows = [json.loads(line) for line in (TASKS_DIR / "capitals.jsonl").read_text().splitlines()]
    assert {row["country"] for row in rows} == set(CAPITALS)
    assert all(row["choices"][row["answer"]] == CAPITALS[row["country"]] for row in rows)
    assert all(len(set(row["choices"])) == 4 and set(row["choices"]) <= set(CAPITALS.values()) for row in rows)
    sums = [json.loads(line) for line in (TASKS_DIR / "sums.jsonl").read_text().splitlines()]
    assert all(row["a"] + row["b"] == row["sum"] for row in sums)


def lm_eval(clients_bin: Path, tmp_path: Path, name: str, model: str, model_args: str, *options: str):
    """Run lm-eval on the tasks; (its scores per task, its samples per task by doc_id)."""
    output = tmp_path / name
    run_client([str(clients_bin / "lm_eval"), "--model", model, "--model_args", model_args,
                "--include_path", str(TASKS_DIR), "--tasks", ",".join(TASKS), "--output_path", str(output),
                "--log_samples", *options], tmp_path, cwd=TASKS_DIR)  # fmt: skip
    [results] = glob.glob(f"{output}/*/results_*.json")
    scores = json.loads(Path(results).read_text())["results"]
    samples = {}
    for task in TASKS:
        [path] = glob.glob(f"{output}/*/samples_{task}_*.jsonl")
        samples[task] = {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}
    return scores, samples


def test_lm_eval_scores_a4_serve_as_it_scores_transformers(served, chat_model_dir, clients_bin, tmp_path):
    served_args = (f"model={MODEL},base_url={served.base_url}/v1/completions,tokenizer={chat_model_dir},"
                   "max_retries=1")  # fmt: skip
    ours, our_samples = lm_eval(clients_bin, tmp_path, "a4", "local-completions", served_args, "--batch_size", "4")
    theirs, their_samples = lm_eval(clients_bin, tmp_path, "hf", "hf", f"pretrained={chat_model_dir},dtype=float32",
                                    "--batch_size", "1", "--device", "cpu")  # fmt: skip
    assert ours["tiny_world_capitals"]["acc,none"] == theirs["tiny_world_capitals"]["acc,none"]
    assert ours["tiny_world_sums"]["exact_match,none"] == theirs["tiny_world_sums"]["exact_match,none"]
    for doc_id, sample in their_samples["tiny_world_capitals"].items():
        # Per choice: (log-likelihood of the choice after the question, whether it is the greedy continuation).
        for [[loglikelihood, greedy]], [[our_loglikelihood, our_greedy]] in zip(
            sample["resps"], our_samples["tiny_world_capitals"][doc_id]["resps"], strict=True
        ):
            assert abs(float(loglikelihood) - float(our_loglikelihood)) <= LOGLIKELIHOOD_TOLERANCE, sample["doc"]
            assert greedy == our_greedy, sample["doc"]
    for doc_id, sample in their_samples["tiny_world_sums"].items():
        assert our_samples["tiny_world_sums"][doc_id]["resps"] == sample["resps"], sample["doc"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streams_every_request_to_its_end(served, chat_model_dir, clients_bin, tmp_path, route):
    report = tmp_path / "benchmarks.json"
    run_client([str(clients_bin / "guidellm"), "run",
                "--backend", f"kind=openai_http,target={served.base_url},model={MODEL},request_format={route}",
                "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
                "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                "--tokenizer", f"kind=huggingface_auto,model={chat_model_dir}",
                "--output", f"kind=json,path={report}", "--disable-console"], tmp_path)  # fmt: skip
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"], state["cancelled_requests"]) == (4, 0, 0)
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
        assert request["output"]
