"""The step loop: overlap scheduling (`overlap_schedule`) and mixed prefill + decode steps (`enable_mixed_chunk`).

Everything here runs with overlap scheduling forced on (the CUDA default; on the CPU it runs the same path, one step
booked a call late) with mixed steps on and off, and with mixed steps alone, against transformers' greedy tokens (`hf_greedy`): requests that
arrive while others decode, chunked prefill, slot reuse, prefix hits under both hybrid policies (each state
checkpoint checked against transformers' state after its tokens), an end-of-sequence token seen one step late, an
abort of a request in flight (an interrupt in every phase of a step with another in flight is test_fault_injection's).
The engine must end every call as idle as the plain loop leaves it: no step in flight, every slot free, no page or lock
held.
"""

from __future__ import annotations

import json
import shutil

import pytest

from a4 import LLM, SamplingParams
from a4.reference import hf_greedy
from test_fault_injection import assert_clean

PROMPTS = [list(range(3, 40)), [11, 12, 13, 14, 15], list(range(100, 140)), [5, 6], [9, 8, 7, 6, 5, 4, 3]]
MAX_NEW = 6
# (overlap_schedule, enable_mixed_chunk): every combination but the default, which the rest of the suite runs.
LOOPS = [(True, False), (True, True), (False, True)]


def loop_id(loop: tuple[bool, bool]) -> str:
    overlap, mixed = loop
    return f"overlap{int(overlap)}-mixed{int(mixed)}"


def build(checkpoint_dir, loop, **options) -> LLM:
    overlap, mixed = loop
    options = {"max_running_requests": 3, "max_prefill_tokens": 16, **options}
    return LLM(checkpoint_dir, overlap_schedule=overlap, enable_mixed_chunk=mixed, **options)


@pytest.mark.parametrize("loop", LOOPS, ids=loop_id)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_requests_arriving_while_others_decode(request, arch, loop):
    """Two requests decode; three more arrive a few steps in, one of them chunked (16-token budget), and take the
    slots the first ones free (3 slots for 5 requests): every output is transformers' greedy output."""
    checkpoint_dir = request.getfixturevalue(f"tiny_{arch}")
    llm = build(checkpoint_dir, loop)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=MAX_NEW)
    reqs = [engine.add_request(prompt, params) for prompt in PROMPTS[3:]]
    for _ in range(3):
        engine.step()
    reqs += [engine.add_request(prompt, params) for prompt in PROMPTS[:3]]
    engine.run(reqs)
    expected = hf_greedy(checkpoint_dir, PROMPTS[3:] + PROMPTS[:3], MAX_NEW)
    assert [req.output_ids for req in reqs] == expected
    if loop[1]:
        assert engine.stats.mixed_steps > 0, "prompts arrived while others decoded: some step should be mixed"
    assert_clean(llm, checkpoint_dir)


@pytest.mark.parametrize("loop", LOOPS, ids=loop_id)
@pytest.mark.parametrize("arch, policy, page_size", [
    ("qwen3", "checkpoint", 1), ("qwen3_5", "checkpoint", 1), ("qwen3_5", "refuse", 1), ("qwen3_5", "checkpoint", 4),
])  # fmt: skip
def test_prefix_hits_and_slot_reuse(request, arch, policy, page_size, loop):
    """Prompts, then each prompt extended by its answer: hits on what the first call cached (its prompts' states at
    their ends and at chunk boundaries, and its finished requests' states), with slots reused. The hits are those of
    the plain loop: a step in flight changes nothing that the prefix cache keeps."""
    checkpoint_dir = request.getfixturevalue(f"tiny_{arch}")
    params = SamplingParams(max_new_tokens=MAX_NEW)
    cached_tokens = {}
    for run in (loop, (False, False)):
        llm = build(checkpoint_dir, run, hybrid_prefix_policy=policy, page_size=page_size)
        outputs = llm.generate(PROMPTS, params)
        assert [out.token_ids for out in outputs] == hf_greedy(checkpoint_dir, PROMPTS, MAX_NEW)
        follow_ups = [prompt + out.token_ids + [21, 22] for prompt, out in zip(PROMPTS, outputs)]
        outputs = llm.generate(follow_ups, params)
        assert [out.token_ids for out in outputs] == hf_greedy(checkpoint_dir, follow_ups, MAX_NEW)
        assert_clean(llm, checkpoint_dir)
        cached_tokens[run] = [out.cached_tokens for out in outputs]
    assert cached_tokens[loop] == cached_tokens[False, False]
    if policy == "checkpoint":
        # A prompt shorter than a page leaves no checkpoint where its page-aligned KV ends (page_size 4).
        assert all(hit > 0 for hit, prompt in zip(cached_tokens[loop], PROMPTS) if len(prompt) > page_size)


@pytest.mark.parametrize("loop", LOOPS, ids=loop_id)
def test_max_new_tokens_one(tiny_qwen3_5, loop):
    """A request that finishes at its first token is never decoded (overlap: not scheduled again before its booking)."""
    llm = build(tiny_qwen3_5, loop)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=1))
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5, PROMPTS, 1)
    assert llm.stats.decode_steps == 0 and llm.stats.mixed_decode_tokens == 0
    assert_clean(llm, tiny_qwen3_5)


@pytest.mark.parametrize("loop", LOOPS, ids=loop_id)
def test_eos_seen_one_step_late_leaves_the_right_checkpoint(tiny_qwen3_5, tmp_path, loop):
    """A request stops at an end-of-sequence token while others go on. Under overlap scheduling the host books that
    token only after the next step was launched, with the request in it: the extra token is dropped, and the state
    the finished request leaves to the prefix cache is still the state after its prompt and output but the EOS
    (checked against transformers), so that the next turn of the conversation hits it and is exact."""
    stop_token = hf_greedy(tiny_qwen3_5, [PROMPTS[1]], MAX_NEW)[0][2]
    checkpoint_dir = tmp_path / "eos"
    shutil.copytree(tiny_qwen3_5, checkpoint_dir)
    generation_config = checkpoint_dir / "generation_config.json"
    generation_config.write_text(json.dumps(json.loads(generation_config.read_text()) | {"eos_token_id": stop_token}))
    expected = hf_greedy(checkpoint_dir, PROMPTS, MAX_NEW)
    assert expected[1][-1] == stop_token and len(expected[1]) == 3

    llm = build(checkpoint_dir, loop, max_state_checkpoints=64)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == expected
    assert outputs[1].finish_reason == "eos"
    cache = llm.engine.cache_manager.prefix_cache
    held = [tokens for tokens, _ in cache.checkpoints()]
    assert PROMPTS[1] + expected[1][:-1] in held, "the finished request's state should be cached"
    assert_clean(llm, checkpoint_dir)  # every checkpoint = transformers' state after its tokens

    next_turn = PROMPTS[1] + expected[1] + [21, 22]
    output = llm.generate([next_turn], SamplingParams(max_new_tokens=MAX_NEW))[0]
    assert output.token_ids == hf_greedy(checkpoint_dir, [next_turn], MAX_NEW)[0]
    assert output.cached_tokens == len(PROMPTS[1]) + len(expected[1]) - 1


@pytest.mark.parametrize("loop", LOOPS, ids=loop_id)
def test_abort_of_a_request_in_flight(tiny_qwen3_5, loop):
    """Abort a decoding request between two steps (under overlap, while its step is in flight): it finishes
    "abort" with the tokens it had, the others are exact, and the engine ends idle."""
    llm = build(tiny_qwen3_5, loop)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=MAX_NEW)
    reqs = [engine.add_request(prompt, params) for prompt in PROMPTS[1:4]]
    while not reqs[1].output_ids:
        engine.step()
    engine.abort_req(reqs[1])
    assert reqs[1].finished and reqs[1].finish_reason == "abort"
    kept = list(reqs[1].output_ids)
    engine.run([reqs[0], reqs[2]])
    expected = hf_greedy(tiny_qwen3_5, PROMPTS[1:4], MAX_NEW)
    assert [reqs[0].output_ids, reqs[2].output_ids] == [expected[0], expected[2]]
    assert reqs[1].output_ids == kept == expected[1][: len(kept)]
    assert_clean(llm, tiny_qwen3_5)


def test_seeded_sampling_does_not_depend_on_the_loop(tiny_qwen3_5):
    """A seeded request draws from its own generator, once per token: the same tokens whatever the loop."""
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=i) for i in range(len(PROMPTS))]
    outputs = {
        loop: [out.token_ids for out in build(tiny_qwen3_5, loop).generate(PROMPTS, params)]
        for loop in [(False, False), *LOOPS]
    }
    assert len({tuple(map(tuple, tokens)) for tokens in outputs.values()}) == 1, outputs


@pytest.mark.parametrize("option", ["overlap_schedule", "enable_mixed_chunk"])
def test_speculative_decoding_refuses_overlap_and_mixed_steps(tiny_qwen3_5, option):
    with pytest.raises(ValueError, match=f"{option}=True cannot be combined with speculative_tokens"):
        LLM(tiny_qwen3_5, speculative_tokens=2, **{option: True})


def test_tensor_parallel_with_overlap_and_mixed_steps(tiny_qwen3_5):
    """Rank 0 broadcasts each step, its device-side inputs included: two ranks, greedy = transformers."""
    with build(tiny_qwen3_5, (True, True), tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)


def test_a_mixed_step_runs_its_decodes_as_a_decode_step(tiny_qwen3_5, monkeypatch):
    """A mixed step's backends run its prompt as an EXTEND and its decodes as a DECODE (`MixedBackend`): notebook
    04's chunked rule and the attention's per-request prefill see the prompt alone, the one-token recurrent step and
    the batched decode attention see the decoding requests together, in the same step. Output = transformers."""
    import a4.layers.attention as attention
    import a4.layers.gdn_backend as gdn_backend

    calls = []

    def recording(module, name, count):
        original = getattr(module, name)

        def record(*args):
            calls.append((name, count(*args)))
            return original(*args)

        monkeypatch.setattr(module, name, record)

    recording(gdn_backend, "chunk_gated_delta_rule", lambda *args: len(args[-2]) - 1)  # sequences (cu_seqlens)
    recording(gdn_backend, "recurrent_gated_delta_rule", lambda *args: args[0].shape[0])  # rows
    recording(attention, "_extend_attention", lambda q, k, v, k_buf, v_buf, fb, scale: fb.batch_size)
    recording(attention, "_decode_attention", lambda q, k_buf, v_buf, meta, scale: q.shape[0])
    llm = build(tiny_qwen3_5, (False, True), max_prefill_tokens=64)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=MAX_NEW)
    reqs = [engine.add_request(prompt, params) for prompt in PROMPTS[3:5]]
    while not all(req.output_ids for req in reqs):
        engine.step()
    reqs.append(engine.add_request(PROMPTS[0], params))
    calls.clear()
    engine.step()
    assert engine.stats.mixed_steps == 1
    assert set(calls) == {("chunk_gated_delta_rule", 1), ("recurrent_gated_delta_rule", 2), ("_extend_attention", 1),
                          ("_decode_attention", 2)}  # fmt: skip
    engine.run(reqs)
    assert [req.output_ids for req in reqs] == hf_greedy(tiny_qwen3_5, [*PROMPTS[3:5], PROMPTS[0]], MAX_NEW)
    assert_clean(llm, tiny_qwen3_5)


def test_a_captured_first_prefill_is_not_mixed(tiny_qwen3_5):
    """With the static runner (`cuda_graphs=True`, on the CPU its GPU path run eagerly), a prompt's first prefill
    runs as one captured step: mixing the decodes into it would run them all eagerly, so it runs alone. The later
    chunks of a long prompt run eagerly anyway and carry the decodes. Output = transformers either way."""
    llm = LLM(tiny_qwen3_5, cuda_graphs=True, overlap_schedule=True, enable_mixed_chunk=True, max_prefill_tokens=16)
    engine, stats = llm.engine, llm.engine.stats
    params = SamplingParams(max_new_tokens=MAX_NEW + 6)
    reqs = [engine.add_request(PROMPTS[3], params)]
    engine.step()
    reqs.append(engine.add_request(PROMPTS[1], params))  # 5 tokens: one captured first prefill
    while not reqs[1].output_ids:
        engine.step()
    assert stats.mixed_steps == 0
    reqs.append(engine.add_request(PROMPTS[0], params))  # 37 tokens: a captured first chunk, then mixed ones
    engine.run(reqs)
    assert stats.mixed_steps > 0
    assert [req.output_ids for req in reqs] == hf_greedy(tiny_qwen3_5, [PROMPTS[3], PROMPTS[1], PROMPTS[0]], MAX_NEW + 6)
    assert_clean(llm, tiny_qwen3_5)
