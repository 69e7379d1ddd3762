"""The server's sampling fields beyond temperature / top_k / top_p (penalties, logit_bias, min_tokens, min_p,
stop_token_ids) and `n` > 1, through a real uvicorn server, the `openai` client and raw HTTP, against transformers
(greedy, or the logits processed by test_sampling_params' plain loops) and against single requests."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import MODEL, WAIT_SECONDS, client, reference, wait_for

from a4 import SamplingParams
from test_sampling_params import naive_greedy

PROMPT = "The cat says meow. The dog"


def idle(engine) -> bool:
    """Every slot free, nothing locked, every page free or the prefix cache's (the padding slot's aside)."""
    allocator, cache = engine.cache_manager.allocator, engine.cache_manager.prefix_cache
    held = allocator.num_pages - allocator.num_free_pages - cache.evictable_size // allocator.page_size
    return (engine.table_manager.available_size == engine.memory_plan.max_running_requests
            and cache.protected_size == 0 and held == engine.runner.padding_pages)  # fmt: skip


def test_penalties_and_logit_bias_are_the_references(server, chat_model_dir, tokenizer):
    base_url, _ = server
    ids = tokenizer.encode(PROMPT)
    fields = {"presence_penalty": -2.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"13": -5}}
    response = client(base_url).completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, presence_penalty=-2.0, frequency_penalty=0.5,
        logit_bias={"13": -5}, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})  # fmt: skip
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **fields | {"logit_bias": {13: -5.0}})
    expected = naive_greedy(chat_model_dir, ids, params)
    assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_stop_token_ids_and_min_tokens(server, chat_model_dir, tokenizer):
    """A stop token id ends the text before it (its text is not output, as in vLLM), finish_reason "stop"; the
    token counts in the usage. min_tokens holds it back until then."""
    base_url, _ = server
    ids = tokenizer.encode(PROMPT)
    text, _, _ = reference(chat_model_dir, tokenizer, ids, 10)
    greedy = naive_greedy(chat_model_dir, ids, SamplingParams(max_new_tokens=10, ignore_eos=True))
    stop = greedy[3]
    response = client(base_url).completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                                   extra_body={"stop_token_ids": [stop]})  # fmt: skip
    choice = response.choices[0]
    first = greedy.index(stop)
    assert (choice.text, choice.finish_reason) == (tokenizer.decode(greedy[:first]), "stop")
    assert response.usage.completion_tokens == first + 1
    late = SamplingParams(max_new_tokens=10, min_tokens=first + 2, stop_token_ids=(stop,))
    response = client(base_url).completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                                   extra_body={"stop_token_ids": [stop], "min_tokens": first + 2})  # fmt: skip
    expected = naive_greedy(chat_model_dir, ids, late, [1000, 1002])
    stopped = expected[-1] == stop
    assert response.choices[0].text == tokenizer.decode(expected[: len(expected) - stopped], skip_special_tokens=True)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"n": 0}, "n"), ({"n": 5}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{param}={fields}" for fields, param in BAD])
def test_bad_sampling_fields_are_a_400_naming_them(server, fields, param):
    base_url, engine_loop = server
    body = {"prompt": "x", "max_tokens": 2, **fields}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=WAIT_SECONDS)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    wait_for(lambda: idle(engine_loop.engine), "the engine to be idle")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_greedy_samples_are_transformers_and_share_one_prefill(server, chat_model_dir, tokenizer, stream):
    """Two prompts, three greedy samples each: every choice is transformers' text, indices i * n + j, the usage counts
    each prompt once, and each prompt was prefilled once (its samples forked from it)."""
    base_url, engine_loop = server
    texts = ["Once upon a time, a green fox", "What is 3 plus 4?"]
    ids = [tokenizer.encode(text) for text in texts]
    expected = [reference(chat_model_dir, tokenizer, one, 8) for one in ids]
    stats = engine_loop.engine.stats
    prefilled_before = stats.prefill_tokens
    request = dict(model=MODEL, prompt=texts, max_tokens=8, temperature=0, n=3)
    if stream:
        chunks = list(client(base_url).completions.create(**request, stream=True,
                                                          stream_options={"include_usage": True}))  # fmt: skip
        choices = [c for chunk in chunks for c in chunk.choices]
        got = {i: ("".join(c.text for c in choices if c.index == i),
                   next(c.finish_reason for c in choices if c.index == i and c.finish_reason)) for i in range(6)}  # fmt: skip
        usage = chunks[-1].usage
    else:
        response = client(base_url).completions.create(**request)
        got = {choice.index: (choice.text, choice.finish_reason) for choice in response.choices}
        usage = response.usage
    assert got == {i * 3 + j: expected[i][:2] for i in range(2) for j in range(3)}
    assert usage.prompt_tokens == sum(map(len, ids))
    assert usage.completion_tokens == 3 * sum(count for *_, count in expected)
    assert stats.prefill_tokens - prefilled_before <= sum(map(len, ids))
    wait_for(lambda: idle(engine_loop.engine), "the engine to be idle")


def test_n_seeded_chat_samples_are_independent(server):
    """Sample j of n with a seed is the single request with seed + j (vLLM's rule): independent draws."""
    base_url, engine_loop = server
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a fox."}],
                   max_tokens=10, temperature=1.0)  # fmt: skip
    reply = client(base_url).chat.completions.create(**request, n=3, seed=7)
    samples = [choice.message.content for choice in sorted(reply.choices, key=lambda choice: choice.index)]
    singles = [client(base_url).chat.completions.create(**request, seed=7 + j).choices[0].message.content
               for j in range(3)]  # fmt: skip
    assert samples == singles and len(set(samples)) > 1
    wait_for(lambda: idle(engine_loop.engine), "the engine to be idle")


def test_n_samples_of_a_client_that_disconnects_mid_stream_are_freed(server):
    base_url, engine_loop = server
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=WAIT_SECONDS) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line).startswith("data: ")
    wait_for(lambda: idle(engine_loop.engine), "the samples' slots, pages and locks to be freed")
