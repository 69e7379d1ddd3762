"""`python -m a4 serve`: a real uvicorn server on 127.0.0.1 (an ephemeral port), talked to with the official `openai`
client (and httpx where a body must be malformed), against transformers' greedy text of the same prompt.

The server runs in a thread of this process for most tests (so a test can look at its engine); the shutdown tests
start `python -m a4 serve` as a user does and signal it. Waits are bounded and fail saying what did not happen.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import openai
import pytest
from server_helpers import (
    MODEL,
    WAIT_SECONDS,
    chat_prompt_ids,
    client,
    launched_server,
    long_stream,
    metric_values,
    reference,
    running_server,
    wait_for,
)

from a4 import tiny_corpus
from a4.course.demo import needs_exercise
from a4.course.exercises import not_written_yet
from a4.reference import hf_greedy
from a4.server.detokenizer import IncrementalDetokenizer
from a4.server.launch import build_app


@pytest.fixture(scope="module")
def one_slot_server(chat_model_dir, tokenizer):
    """One request at a time and no queue: a second request is refused while one runs."""
    app = build_app(chat_model_dir, tokenizer, max_running_requests=1, max_queued_requests=0)
    with running_server(app) as base_url:
        yield base_url, app.state.engine_loop


# ------------------------------------------------------------------------------------------------- generation


def test_models_health_and_metrics(server):
    base_url, _ = server
    [model] = client(base_url).models.list().data
    assert model.id == MODEL
    assert httpx.get(f"{base_url}/health").status_code == 200
    metrics = httpx.get(f"{base_url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used", "kv_pages_total",
                 "state_slots_used", "state_slots_total", "cache_hit_rate", "decode_tokens_per_second",
                 "generation_tokens_total"):  # fmt: skip
        assert f"\na4:{name}" in metrics, name


@pytest.mark.parametrize("prompt", ["The quick brown fox", [17, 230, 5, 999, 41, 8]], ids=["text", "token ids"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_is_transformers_greedy_text(server, chat_model_dir, tokenizer, prompt, stream):
    base_url, _ = server
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    text, finish, num_tokens = reference(chat_model_dir, tokenizer, prompt_ids, 24)
    request = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    if not stream:
        response = client(base_url).completions.create(**request)
        got, got_finish, usage = response.choices[0].text, response.choices[0].finish_reason, response.usage
    else:
        stream = client(base_url).completions.create(**request, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        got = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        got_finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
        usage = chunks[-1].usage
        assert not chunks[-1].choices, "the usage chunk comes last, with no choices"
    assert (got, got_finish) == (text, finish)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), num_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_is_transformers_greedy_text_of_the_chat_template(server, chat_model_dir, tokenizer, stream):
    base_url, _ = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
    text, finish, _ = reference(chat_model_dir, tokenizer, chat_prompt_ids(tokenizer, messages), 16)
    request = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    if not stream:
        choice = client(base_url).chat.completions.create(**request).choices[0]
        got, got_finish = choice.message.content, choice.finish_reason
    else:
        chunks = list(client(base_url).chat.completions.create(**request, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        got_finish = chunks[-1].choices[0].finish_reason
    assert (got, got_finish) == (text, finish)


def test_multi_turn_chat_reuses_the_first_turn_from_the_prefix_cache(server, tokenizer):
    base_url, _ = server
    messages = [{"role": "user", "content": "Tell me about the lazy dog."}]
    first = client(base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the fox?"}]  # fmt: skip
    second = client(base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    # The second prompt starts with the first (the template renders each message alike), whose end has a state
    # checkpoint on the radix tree: the hybrid model reuses at least that much.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_16_concurrent_streaming_clients_each_get_their_own_reference(server, chat_model_dir, tokenizer):
    base_url, engine_loop = server
    # Story openings, which the trained model continues past 12 tokens (a prompt it ends at once decodes nothing).
    prompts = [f"Once upon a time, there was a little fox named {name}." for name in tiny_corpus.NAMES[:16]]
    expected = [reference(chat_model_dir, tokenizer, tokenizer.encode(p), 12)[0] for p in prompts]
    stats = engine_loop.engine.stats
    steps_before, request_steps_before = stats.decode_steps, stats.decode_request_steps

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)  # fmt: skip
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    assert asyncio.run(all_of_them()) == expected
    # Continuous batching: the clients' requests shared decode steps.
    assert stats.decode_request_steps - request_steps_before > stats.decode_steps - steps_before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_the_text_before_it(server, chat_model_dir, tokenizer, stream):
    base_url, _ = server
    prompt = "Continuous batching"
    text, _, _ = reference(chat_model_dir, tokenizer, tokenizer.encode(prompt), 32)
    stop = text[len(text) // 2 :][:2]
    request = dict(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=["never in the text", stop])
    if stream:
        chunks = list(client(base_url).completions.create(**request, stream=True))
        got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client(base_url).completions.create(**request).choices[0]
        got, finish = choice.text, choice.finish_reason
    assert (got, finish) == (text[: text.index(stop)], "stop")


def test_seed_reproduces_a_sampled_completion_and_ignore_eos_runs_to_max_tokens(server):
    base_url, _ = server
    request = dict(model=MODEL, prompt="The lazy dog", max_tokens=20, temperature=1.0, top_p=0.9, seed=7,
                   extra_body={"ignore_eos": True})  # fmt: skip
    first, second = (client(base_url).completions.create(**request) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == 20 and first.choices[0].finish_reason == "length"


def test_detokenizer_never_releases_a_broken_character(tokenizer):
    # "🙂" is four UTF-8 bytes; byte-level tokens can hold one byte each.
    ids = tokenizer.encode("a🙂b é 深")
    byte_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer)
    pieces = [detokenizer.add([token]) for token in byte_ids]
    assert "".join(pieces) + detokenizer.finish() == "a🙂b é 深"
    assert all("\ufffd" not in piece for piece in pieces)


# ----------------------------------------------------------------------------------------------------- errors


BAD_COMPLETIONS = [
    ("malformed JSON", b'{"prompt": "x",', None),
    ("wrong type", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("prompt of the wrong type", {"prompt": 5}, "prompt"),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("infinite temperature", b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    ("NaN temperature", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("n beyond the running requests", {"prompt": "x", "n": 5}, "n"),
    ("unknown field", {"prompt": "x", "max_token": 8}, "max_token"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("empty prompt", {"prompt": []}, "prompt"),
    ("token outside the vocabulary", {"prompt": [1, 5000]}, "prompt"),
    ("prompt longer than the context", {"prompt": [7] * 5000}, "prompt"),
]


@pytest.mark.parametrize("body, param", [c[1:] for c in BAD_COMPLETIONS], ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_input_is_a_400_in_openai_shape_and_the_server_goes_on(server, body, param):
    base_url, _ = server
    if isinstance(body, bytes):
        response = httpx.post(f"{base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["param"] == param, error
    assert client(base_url).completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


STUB = "Exercise spec-conv-verify: the conv over L tokens per request (notebooks/11_speculative.ipynb)"


def test_an_unwritten_exercise_is_a_500_naming_it_and_one_log_line(server, monkeypatch, caplog, capsys):
    """A student's handout (notebook 12 before notebook 11's exercises): the client's error names the exercise, and
    so does the log, in one line rather than a traceback; a notebook's needs_exercise() says which one is missing."""
    base_url, engine_loop = server

    def unwritten(*args, **kwargs):
        raise NotImplementedError(STUB)

    monkeypatch.setattr(engine_loop.engine.worker, "launch", unwritten)
    with pytest.raises(openai.InternalServerError) as raised:
        client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert f"NotImplementedError: {STUB}" in raised.value.message
    with needs_exercise():
        client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert f"Not implemented yet. {STUB}" in capsys.readouterr().out
    logged = [r for r in caplog.records if r.name == "a4.server.engine_loop"]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in logged] == [
        ("ERROR", f"an engine step raised: {not_written_yet(STUB)}", None)
    ] * 2
    monkeypatch.undo()
    # Served again (the trained model may answer "Hi" with its end-of-sequence token at once: no text, one token).
    served = client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert served.choices[0].finish_reason in ("stop", "length") and served.usage.completion_tokens >= 1


def test_prompt_longer_than_the_context_is_named_so(server):
    base_url, _ = server
    with pytest.raises(openai.BadRequestError) as raised:
        client(base_url).completions.create(model=MODEL, prompt=[7] * 5000, max_tokens=2)
    assert raised.value.code == "context_length_exceeded" and "too long" in raised.value.message


def test_bad_chat_messages_and_an_unknown_model(server):
    base_url, _ = server
    with pytest.raises(openai.BadRequestError, match="messages"):
        client(base_url).chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="role"):
        client(base_url).chat.completions.create(model=MODEL, messages=[{"role": "bot", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as raised:
        client(base_url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2, max_completion_tokens=2)  # fmt: skip
    assert raised.value.param == "max_completion_tokens"
    with pytest.raises(openai.NotFoundError) as raised:
        client(base_url).completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert raised.value.code == "model_not_found"
    assert httpx.get(f"{base_url}/v1/nowhere").json()["error"]["type"] == "not_found_error"


# ------------------------------------------------------------------------------------- one slot: queue, aborts


def running_and_slots(base_url: str) -> tuple[float, float]:
    values = metric_values(base_url)
    return values["a4:num_requests_running"], values["a4:state_slots_used"]


def test_past_the_queue_bound_a_503_with_retry_after(one_slot_server):
    base_url, _ = one_slot_server
    with long_stream(base_url):
        response = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert response.json()["error"]["code"] == "server_busy"
        assert running_and_slots(base_url) == (1, 1), "the running request was disturbed"
    wait_for(lambda: running_and_slots(base_url) == (0, 0), "the slot to be freed")


def test_a_disconnected_client_frees_its_slot(one_slot_server, chat_model_dir, tokenizer):
    base_url, engine_loop = one_slot_server
    with long_stream(base_url):
        pass  # hangs up after the first token
    wait_for(lambda: running_and_slots(base_url) == (0, 0), "the streamed request's slot to be freed")
    # A client waiting for a whole response that gives up (its timeout) aborts it too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 4000, "ignore_eos": True},
                   timeout=1.0)  # fmt: skip
    wait_for(lambda: running_and_slots(base_url) == (0, 0), "the non-streamed request's slot to be freed")
    allocator = engine_loop.engine.cache_manager.allocator
    assert engine_loop.engine.table_manager.available_size == 1 and allocator.num_free_pages > 0
    # The one slot serves the next request, correctly.
    text, _, _ = reference(chat_model_dir, tokenizer, tokenizer.encode("The dog"), 8)
    response = client(base_url).completions.create(model=MODEL, prompt="The dog", max_tokens=8, temperature=0)
    assert response.choices[0].text == text


# ----------------------------------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_shuts_the_server_down_cleanly_even_mid_stream(chat_model_dir, signum):
    # As a user starts it: one request at a time, its API key from the environment.
    key = {"Authorization": "Bearer sekrit"}
    with launched_server(chat_model_dir, "--max-running-requests", "1", env={"A4_API_KEY": "sekrit"}) as server:
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
        with long_stream(server.base_url, headers=key) as events:
            queued = []
            body = {"prompt": "x", "max_tokens": 2}
            waiting = threading.Thread(target=lambda: queued.append(httpx.post(
                f"{server.base_url}/v1/completions", json=body, headers=key, timeout=WAIT_SECONDS)))  # fmt: skip
            waiting.start()
            wait_for(lambda: metric_values(server.base_url)["a4:num_requests_waiting"] == 1, "a request to queue")
            server.process.send_signal(signum)
            # The request in flight is aborted, and its stream ends properly.
            *_, aborted, done = [event for event in events if event]
            assert "shutting down" in json.loads(aborted.removeprefix("data: "))["error"]["message"]
            assert done == "data: [DONE]"
            # The queued one is told to retry: the server had not started it.
            waiting.join(WAIT_SECONDS)
            [response] = queued
            assert response.status_code == 503 and response.headers["Retry-After"] == "1", response.text
            assert "shutting down" in response.json()["error"]["message"]
        server.process.wait(WAIT_SECONDS)
        assert server.process.returncode == 0, server.log
        assert "Application shutdown complete" in server.log and "Traceback" not in server.log, server.log


def test_the_gpu_warm_up_leaves_the_engine_as_built(chat_model_dir):
    # `build_app` warms a GPU engine up (launch.warm_up); run here on the CPU: afterwards every slot and KV page is
    # free again, the counters are zero, and the next request is still transformers' greedy continuation.
    from a4 import SamplingParams
    from a4.engine.engine import Engine, EngineConfig
    from a4.server.launch import warm_up

    engine = Engine(EngineConfig(chat_model_dir, max_running_requests=4, max_prefill_tokens=64,
                                 enable_prefix_cache=False))  # fmt: skip
    free_slots, free_pages = engine.runner.table_manager.available_size, engine.runner.allocator.num_free_pages
    warm_up(engine)
    assert engine.stats.prefill_tokens == engine.stats.decode_tokens == 0
    assert engine.runner.table_manager.available_size == free_slots
    assert engine.runner.allocator.num_free_pages == free_pages
    prompt = [5, 9, 200, 31, 7]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=6))
    engine.run([req])
    assert req.output_ids == hf_greedy(chat_model_dir, [prompt], 6)[0]
