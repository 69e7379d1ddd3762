"""Logprobs, echo, /tokenize and /detokenize through a real uvicorn server, with the `openai` client and raw HTTP:
every logprob against transformers' log-softmax of its float32 logits along the same tokens, the token ids of
/tokenize against the tokenizer's, and bad values refused with a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import MODEL, WAIT_SECONDS, chat_prompt_ids, client

from a4.course.checks._harness import model_reduction_length, tolerance
from a4.models.config import load_model_config
from a4.reference import hf_log_softmax

TOP = 3


def expected_rows(model_dir, ids: list[int]) -> tuple[torch.Tensor, float]:
    """transformers' log-softmax along ids (row i scores ids[i + 1]), and the difference float32 rounding allows."""
    rows = hf_log_softmax(model_dir, ids)
    reduction = model_reduction_length(load_model_config(model_dir), len(ids))
    return rows, 2 * tolerance(torch.float32, reduction) * rows.abs().max().item()


def assert_top_is_transformers(top: dict[str, float] | list, row: torch.Tensor, tokenizer, allowed: float) -> None:
    """The listed most likely tokens' logprobs are transformers' largest, and each one's own value."""
    pairs = list(top.items()) if isinstance(top, dict) else [(t.token, t.logprob) for t in top]
    values = torch.tensor(sorted((value for _, value in pairs), reverse=True))
    torch.testing.assert_close(values, row.topk(len(pairs)).values, atol=allowed, rtol=0)
    for token, value in pairs:
        [token_id] = tokenizer.encode(token, add_special_tokens=False)
        assert abs(row[token_id].item() - value) <= allowed, (token, value)


def post(base_url: str, path: str, body: dict | str) -> httpx.Response:
    """POST body (a str: JSON text as it is, e.g. a lone surrogate's escape)."""
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{base_url}/{path}", content=content, headers={"content-type": "application/json"},
                      timeout=WAIT_SECONDS)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_are_transformers_log_softmax(server, chat_model_dir, tokenizer, stream):
    base_url, _ = server
    prompt = "The capital of France is"
    prompt_ids = tokenizer.encode(prompt)
    request = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=TOP)
    if stream:
        chunks = [c.choices[0] for c in client(base_url).completions.create(**request, stream=True) if c.choices]
        text = "".join(c.text for c in chunks)
        logprobs = [c.logprobs for c in chunks if c.logprobs is not None]
        tokens = [t for lp in logprobs for t in lp.tokens]
        token_logprobs = [v for lp in logprobs for v in lp.token_logprobs]
        top_logprobs = [v for lp in logprobs for v in lp.top_logprobs]
        offsets = [v for lp in logprobs for v in lp.text_offset]
    else:
        [choice] = client(base_url).completions.create(**request).choices
        text, lp = choice.text, choice.logprobs
        tokens, token_logprobs, top_logprobs, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    output_ids = tokenizer.encode("".join(tokens))
    assert "".join(tokens) == text and output_ids
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    rows, allowed = expected_rows(chat_model_dir, prompt_ids + output_ids)
    for i, (token_id, value, top) in enumerate(zip(output_ids, token_logprobs, top_logprobs, strict=True)):
        row = rows[len(prompt_ids) - 1 + i]
        assert abs(row[token_id].item() - value) <= allowed
        # Greedy: the token is the most likely, so the dict is the k most likely (OpenAI: the token's and the top k).
        assert len(top) == TOP
        assert_top_is_transformers(top, row, tokenizer, allowed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_and_top_logprobs_are_transformers_log_softmax(server, chat_model_dir, tokenizer, stream):
    base_url, _ = server
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    request = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=TOP)
    if stream:
        chunks = [c.choices[0] for c in client(base_url).chat.completions.create(**request, stream=True) if c.choices]
        content = [t for c in chunks if c.logprobs is not None for t in c.logprobs.content]
        text = "".join(c.delta.content or "" for c in chunks)
    else:
        [choice] = client(base_url).chat.completions.create(**request).choices
        content, text = choice.logprobs.content, choice.message.content
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    output_ids = [tokenizer.encode(t.token, add_special_tokens=False)[0] for t in content]
    assert tokenizer.decode(output_ids, skip_special_tokens=True) == text
    rows, allowed = expected_rows(chat_model_dir, prompt_ids + output_ids)
    for i, (token_id, entry) in enumerate(zip(output_ids, content)):
        row = rows[len(prompt_ids) - 1 + i]
        assert abs(row[token_id].item() - entry.logprob) <= allowed
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == TOP and entry.top_logprobs[0].token == entry.token  # greedy
        assert_top_is_transformers(entry.top_logprobs, row, tokenizer, allowed)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks_for_them(server, chat_model_dir, tokenizer, max_tokens):
    """lm-eval's log-likelihood request: token-id prompts in one batch, echo, logprobs 1, max_tokens 0 or 1."""
    base_url, _ = server
    prompts = [tokenizer.encode(text) for text in ("The capital of France is Paris.", "Two plus two is four")]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    response = post(base_url, "v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    for prompt_ids, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt_ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing scores the first
        assert choice["text"].startswith(tokenizer.decode(prompt_ids))
        rows, allowed = expected_rows(chat_model_dir, prompt_ids)
        for position in range(1, len(prompt_ids)):
            row = rows[position - 1]
            assert abs(lp["token_logprobs"][position] - row[prompt_ids[position]].item()) <= allowed
            top = lp["top_logprobs"][position]
            assert len(top) in (1, 2) and max(top.values()) == pytest.approx(row.max().item(), abs=allowed)
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == max_tokens * len(prompts)
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_with_logprobs_opens_each_of_n_choices(server, chat_model_dir, tokenizer):
    """n samples of a prompt share its one prefill: each choice opens with the prompt and its logprobs (as vLLM's)."""
    base_url, _ = server
    prompt_ids = tokenizer.encode("The capital of France is Paris.")
    body = {"model": MODEL, "prompt": prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 3, "n": 2,
            "temperature": 1.0, "seed": 1}  # fmt: skip
    response = post(base_url, "v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1]
    rows, allowed = expected_rows(chat_model_dir, prompt_ids)
    for choice in choices:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt_ids) + 3 and lp["token_logprobs"][0] is None
        for position in range(1, len(prompt_ids)):
            assert abs(lp["token_logprobs"][position] - rows[position - 1][prompt_ids[position]].item()) <= allowed
        assert all(value is not None for value in lp["token_logprobs"][len(prompt_ids) :])


def test_echo_streams_the_prompt_first(server, tokenizer):
    base_url, _ = server
    request = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    whole = client(base_url).completions.create(**request).choices[0].text
    chunks = [c.choices[0] for c in client(base_url).completions.create(**request, echo=True, stream=True)]
    assert chunks[0].text.startswith("The capital of France is")
    assert "".join(c.text for c in chunks) == "The capital of France is" + whole


def test_tokenize_and_detokenize_are_the_tokenizers(server, tokenizer):
    base_url, engine_loop = server
    text = "The capital of France is Paris. <|im_end|>"
    response = post(base_url, "tokenize", {"prompt": text}).json()
    assert response == {"tokens": tokenizer.encode(text), "count": len(tokenizer.encode(text)),
                        "max_model_len": engine_loop.engine.max_context_len}  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(base_url, "tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == chat_prompt_ids(tokenizer, messages)
    without = post(base_url, "tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    assert post(base_url, "detokenize", {"tokens": response["tokens"]}).json() == {"prompt": text}


REFUSED = [
    ("v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ("tokenize", {"prompt": 5}, "prompt"),
    ("tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("tokenize", {"messages": []}, "messages"),
    ("tokenize", {"prompt": "x", "model": "gpt-5"}, "model"),
    ("detokenize", {"tokens": [5, 100000]}, "tokens"),
    ("detokenize", {"tokens": "5"}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", REFUSED, ids=[f"{r[0]}: {r[2]}" for r in REFUSED])
def test_bad_values_are_a_400_naming_the_field(server, path, body, param):
    base_url, engine_loop = server
    response = post(base_url, path, body)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
    assert engine_loop.engine.table_manager.available_size == engine_loop.engine.memory_plan.max_running_requests
