"""What the clients people point at an OpenAI-compatible server send (the `openai` client, lm-evaluation-harness,
guidellm), against a real uvicorn server on 127.0.0.1, each answer checked against transformers' greedy text."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import MODEL, WAIT_SECONDS, chat_prompt_ids, client, reference


def test_a_model_is_retrieved_by_name(server):
    base_url, _ = server
    assert client(base_url).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as raised:
        client(base_url).models.retrieve("gpt-5")
    assert raised.value.code == "model_not_found" and raised.value.param == "model"


def test_content_parts_developer_role_user_and_zero_penalties(server, chat_model_dir, tokenizer):
    base_url, _ = server
    # Text parts are joined by newlines (as vLLM does); "developer" is OpenAI's name for the system role.
    expected_messages = [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "Tell me\nabout the lazy dog."}]  # fmt: skip
    text, finish, _ = reference(chat_model_dir, tokenizer, chat_prompt_ids(tokenizer, expected_messages), 10)
    reply = client(base_url).chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, user="user-1234", presence_penalty=0, frequency_penalty=0.0,
        messages=[{"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                               {"type": "text", "text": "about the lazy dog."}]}],
    )  # fmt: skip
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (text, finish)


REFUSED = [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only 'text' parts"),
    ("completions", {"n": 2, "best_of": 3}, "best_of", "not supported"),
]


@pytest.mark.parametrize("route, fields, param, says", REFUSED, ids=[f"{r[0]}: {r[2]}" for r in REFUSED])
def test_what_a4_does_not_serve_yet_is_a_400_naming_the_field(server, route, fields, param, says):
    base_url, _ = server
    if route == "chat":
        body, path = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}, "chat/completions"
    else:
        body, path = {"prompt": "x", "max_tokens": 2, **fields}, "completions"
    response = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=WAIT_SECONDS)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    base_url, _ = server
    request = dict(model=MODEL, max_tokens=12, temperature=0, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    whole = client(base_url).completions.create(model=MODEL, prompt="The lazy dog", max_tokens=12, temperature=0)
    chunks = list(client(base_url).completions.create(prompt="The lazy dog", **request))
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    chat = list(client(base_url).chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **request))
    assert all(chunk.usage is not None for chunk in chat) and chat[0].usage.completion_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["texts", "token ids", "lists of token ids"])
def test_several_prompts_get_one_choice_each_batched_in_the_engine(server, chat_model_dir, tokenizer, kind, stream):
    base_url, engine_loop = server
    texts = ["The fox and the dog.", "Request two: the lazy dog", "Once upon a time", "A green garden"]
    ids = [tokenizer.encode(text) for text in texts]
    if kind == "token ids":  # one prompt of token ids: one choice
        texts, ids = texts[:1], ids[:1]
    prompt = {"texts": texts, "token ids": ids[0], "lists of token ids": ids}[kind]
    expected = [reference(chat_model_dir, tokenizer, one, 10)[:2] for one in ids]
    stats = engine_loop.engine.stats
    steps_before, request_steps_before = stats.decode_steps, stats.decode_request_steps
    request = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    if stream:
        choices = [chunk.choices[0] for chunk in client(base_url).completions.create(**request, stream=True)]
        got = [("".join(c.text for c in choices if c.index == i),
                next(c.finish_reason for c in choices if c.index == i and c.finish_reason)) for i in range(len(ids))]
    else:
        response = client(base_url).completions.create(**request)
        assert [choice.index for choice in response.choices] == list(range(len(ids)))
        assert response.usage.prompt_tokens == sum(map(len, ids))
        got = [(choice.text, choice.finish_reason) for choice in response.choices]
    assert got == expected
    if len(ids) > 1:  # each prompt is its own engine request, and they shared decode steps
        assert stats.decode_request_steps - request_steps_before > stats.decode_steps - steps_before


def test_a_bad_prompt_among_several_refuses_the_request_and_runs_none(server):
    base_url, engine_loop = server
    response = httpx.post(f"{base_url}/v1/completions", json={"prompt": [[5, 9], [1, 5000]], "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert engine_loop.engine.table_manager.available_size == engine_loop.engine.memory_plan.max_running_requests
