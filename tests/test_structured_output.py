"""Structured output (`response_format`, a4/engine/grammar.py): greedy JSON of the trained tiny Qwen3.5 under a few
schemas, through the engine (plain, overlap scheduling, speculative: the grammar request undrafted) and the server.

The reference: transformers' logits over the prompt and a4's output, each position masked with the bits that a fresh
xgrammar matcher, fed a4's tokens, gives there; a4's token must be the masked argmax at every position, and the
output must parse with `json.loads` and validate against the schema (jsonschema). Requests without a grammar in the
same batch are transformers' plain greedy output.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from server_helpers import MODEL, WAIT_SECONDS, chat_prompt_ids, client, running_server

from a4 import LLM, SamplingParams
from a4.engine.grammar import GrammarBackend, grammar_error
from a4.models.config import load_model_config
from a4.reference import cached_hf_model, hf_greedy
from a4.server.launch import build_app

# (schema, question): an object with a required string and integer, an enum, an array.
SCHEMAS = {
    "object": ({"type": "object", "required": ["name", "age"],
                "properties": {"name": {"type": "string", "maxLength": 12},
                               "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
               "What is the capital of France?"),
    "enum": ({"type": "object", "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "green", "yellow"]}}},
             "What colour is a banana?"),
    "array": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1,
               "maxItems": 4},
              "What is 2 plus 3?"),
}  # fmt: skip
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def grammars(chat_model_dir, tokenizer) -> GrammarBackend:
    config = load_model_config(chat_model_dir)
    return GrammarBackend(tokenizer, config.vocab_size, config.eos_token_ids)


def masked_greedy_choices(model_dir, grammar: xgr.CompiledGrammar, prompt: list[int], output: list[int]) -> list[int]:
    """At each position of `output`, transformers' most likely token among those the grammar allows after the tokens
    of `output` before it."""
    with torch.no_grad():
        logits = cached_hf_model(model_dir)(torch.tensor([prompt + output])).logits[0].float()
    vocab = torch.arange(logits.shape[-1])
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
    choices = []
    for position, token in enumerate(output):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = (bitmask[0, vocab // 32] >> (vocab % 32)) & 1 == 1  # bit j of the mask: token j is allowed
        choices.append(int(logits[len(prompt) - 1 + position].masked_fill(~allowed, float("-inf")).argmax()))
        assert matcher.accept_token(token), f"a4's token {token} at {position} is not allowed by the grammar"
    assert matcher.is_terminated(), "the output ends before the JSON (and its end-of-sequence token) does"
    return choices


# A speculative engine serves a request with a grammar without drafts (its matcher follows one token a step), the
# request without one beside it with the checkpoint's MTP drafts.
LOOPS = {"plain": {}, "overlap": {"overlap_schedule": True}, "speculative": {"speculative_tokens": 2}}


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_greedy_json_is_transformers_masked_argmax_and_valid(chat_model_dir, tokenizer, grammars, loop):
    llm = LLM(chat_model_dir, max_running_requests=4, **LOOPS[loop])
    engine = llm.engine
    prompts = {name: chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
               for name, (_, question) in SCHEMAS.items()}  # fmt: skip
    compiled = {name: grammars.json_schema(schema) for name, (schema, _) in SCHEMAS.items()}
    reqs = {name: engine.add_request(prompts[name], SamplingParams(max_new_tokens=MAX_TOKENS, grammar=compiled[name]))
            for name in SCHEMAS}  # fmt: skip
    # A request without a grammar in the same batches: transformers' plain greedy output.
    plain = engine.add_request(prompts["object"], SamplingParams(max_new_tokens=MAX_TOKENS))
    # A drawn one: whatever it draws, the grammar allows (an array of at most 4 small integers ends within 40 tokens).
    drawn = engine.add_request(prompts["array"], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, seed=0,
                                                                grammar=compiled["array"]))  # fmt: skip
    engine.run([*reqs.values(), plain, drawn])
    for name, req in reqs.items():
        assert req.finish_reason == "eos", (name, req.finish_reason, tokenizer.decode(req.output_ids))
        assert req.output_ids == masked_greedy_choices(chat_model_dir, compiled[name], prompts[name], req.output_ids)
        value = json.loads(tokenizer.decode(req.output_ids, skip_special_tokens=True))
        jsonschema.validate(value, SCHEMAS[name][0])
    assert plain.output_ids == hf_greedy(chat_model_dir, [prompts["object"]], MAX_TOKENS)[0]
    assert drawn.finish_reason == "eos"
    jsonschema.validate(json.loads(tokenizer.decode(drawn.output_ids, skip_special_tokens=True)), SCHEMAS["array"][0])
    assert not engine.has_unfinished_requests
    assert engine.table_manager.available_size == engine.memory_plan.max_running_requests
    assert not engine.sampler._grammars, "a finished request's grammar matcher was kept"
    if loop == "speculative":
        assert engine.stats.accepted_draft_tokens > 0


def test_a_schema_is_compiled_once(grammars):
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]}
    before = grammars.compiler.get_cache_size_bytes()
    grammars.json_schema(schema)
    size = grammars.compiler.get_cache_size_bytes()
    grammars.json_schema(schema)
    assert grammars.compiler.get_cache_size_bytes() == size > before


def test_what_the_engine_cannot_follow_is_refused(grammars, chat_model_dir, tiny_qwen3_5):
    config, grammar = load_model_config(chat_model_dir), grammars.json_object()
    assert grammar_error(SamplingParams(grammar=grammar), config) is None
    refusals = [
        (SamplingParams(grammar=grammar, ignore_eos=True), config, "ignore_eos"),
        # Compiled for the trained model's 1280 tokens, given to the random tiny model's 1024.
        (SamplingParams(grammar=grammar), load_model_config(tiny_qwen3_5), "vocabulary of 1280 tokens"),
    ]  # fmt: skip
    for params, model_config, says in refusals:
        assert says in grammar_error(params, model_config)
    with pytest.raises(TypeError, match="CompiledGrammar"):
        grammar_error(SamplingParams(grammar=json.dumps({"type": "object"})), config)


# --------------------------------------------------------------------------------------------------------- server


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_schema_through_the_openai_client(server, stream):
    base_url, _ = server
    schema, question = SCHEMAS["object"]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    request = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                   temperature=0, response_format=response_format)  # fmt: skip
    if stream:
        chunks = list(client(base_url).chat.completions.create(stream=True, **request))
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        choice = client(base_url).chat.completions.create(**request).choices[0]
        text, finish_reason = choice.message.content, choice.finish_reason
    assert finish_reason == "stop"
    assert_valid(text, schema)


def test_json_object_and_text_formats_on_both_routes(server, chat_model_dir, tokenizer):
    base_url, _ = server
    messages = [{"role": "user", "content": SCHEMAS["array"][1]}]
    json_object = {"type": "json_object"}
    chat = client(base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, response_format=json_object)  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    # Completions take response_format too (as vLLM's do): the chat's prompt as text gives the same JSON.
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, messages))
    completion = client(base_url).completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, extra_body={"response_format": json_object})
    assert completion.choices[0].text == chat.choices[0].message.content
    # {"type": "text"} is no grammar at all: transformers' greedy text.
    text = client(base_url).completions.create(model=MODEL, prompt="The lazy dog", max_tokens=8, temperature=0,
                                               extra_body={"response_format": {"type": "text"}})  # fmt: skip
    [expected] = hf_greedy(chat_model_dir, [tokenizer.encode("The lazy dog")], 8)
    assert text.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fish"}}},
     "response_format.json_schema.schema", 'Unsupported type "fish"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "response_format.json_schema.schema", "minimum greater than maximum"),
    ({"type": "json_schema"}, "response_format", "json_schema is given with type 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "Field required"),
    ({"type": "yaml"}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
]  # fmt: skip


@pytest.mark.parametrize("response_format, param, says", BAD_FORMATS, ids=[b[2] for b in BAD_FORMATS])
def test_a_bad_response_format_is_a_400_and_the_server_serves_on(server, response_format, param, says):
    base_url, engine_loop = server
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": response_format}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=WAIT_SECONDS)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_ignore_eos_with_a_grammar_is_a_400(server):
    base_url, _ = server
    with pytest.raises(openai.BadRequestError) as raised:
        client(base_url).completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={
            "ignore_eos": True, "response_format": {"type": "json_object"}})  # fmt: skip
    assert raised.value.param == "response_format" and "ignore_eos" in raised.value.message


def test_a_speculative_server_follows_a_grammar(chat_model_dir, tokenizer):
    app = build_app(chat_model_dir, tokenizer, speculative_tokens=1, max_running_requests=2)
    with running_server(app) as base_url:
        answer = client(base_url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 3 plus 4?"}], max_tokens=MAX_TOKENS,
            temperature=0, response_format={"type": "json_object"})  # fmt: skip
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
