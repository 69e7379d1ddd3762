"""a4.reference against transformers used by hand: a plain greedy loop over forward, and the decoder layer's algebra."""

import json
import shutil

import pytest
import torch

from a4.checkpoints import preset_config, preset_generation_config
from a4.course.checks._harness import assert_close, model_reduction_length, tolerance
from a4.models.config import load_model_config
from a4.reference import cached_hf_model, hf_decode_capture, hf_greedy, hf_prefill_capture, hf_token_ranks

PROMPTS = [[5, 17, 300, 42, 9, 800], [1, 2, 3], [999]]


def naive_greedy(model, prompt: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    """Greedy decoding with a full forward over the whole sequence at every step: no generate, no cache."""
    ids, new = list(prompt), []
    with torch.no_grad():
        while len(new) < max_new_tokens:
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            new.append(int(logits.float().argmax()))
            ids.append(new[-1])
            if new[-1] in stop:
                break
    return new


@pytest.mark.parametrize("arch,dtype", [("qwen3", "float32"), ("qwen3_5", "float32"), ("qwen3_5", "bfloat16"),
                                        ("qwen3_5_moe", "float32")])
def test_hf_greedy_matches_a_plain_forward_loop(arch, dtype, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}")
    stop = set(preset_generation_config(arch, "tiny")["eos_token_id"])
    model = cached_hf_model(model_dir, dtype)
    expected = [naive_greedy(model, prompt, 8, stop) for prompt in PROMPTS]
    assert hf_greedy(model_dir, PROMPTS, max_new_tokens=8, dtype=dtype) == expected


def test_hf_greedy_stops_after_the_generation_config_eos(tiny_qwen3_5, tmp_path):
    model = cached_hf_model(tiny_qwen3_5)
    free_run = naive_greedy(model, PROMPTS[0], 8, stop=set())
    # Make the 4th generated token a stop token: generation must end right after its first occurrence.
    stop_token = free_run[3]
    model_dir = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_5, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [stop_token]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    out = hf_greedy(model_dir, [PROMPTS[0]], max_new_tokens=8)[0]
    assert out == free_run[: free_run.index(stop_token) + 1]


def test_hf_token_ranks_ranks_each_token_under_a_plain_forward(tiny_qwen3_5):
    model = cached_hf_model(tiny_qwen3_5)
    prompt = PROMPTS[0]
    greedy = naive_greedy(model, prompt, 4, stop=set())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + greedy[:2]]), use_cache=False).logits[0, -1].float()
    seventh = int(logits.argsort(descending=True)[7])  # the token ranked 7th after prompt + 2 greedy tokens
    ranks = hf_token_ranks(tiny_qwen3_5, [prompt, prompt, [999]], [greedy, greedy[:2] + [seventh], []])
    assert ranks == [[0, 0, 0, 0], [0, 0, 7], []]


def rms_norm_zero_centred(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())).to(x.dtype)


def test_prefill_capture_shapes_and_contents(tiny_qwen3_5):
    t = preset_config("qwen3_5", "tiny")["text_config"]
    H, V, T = t["hidden_size"], t["vocab_size"], 7
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    conv_dim = 2 * key_dim + t["linear_num_value_heads"] * t["linear_value_head_dim"]
    ids = PROMPTS[0] + [77]
    cap = hf_prefill_capture(tiny_qwen3_5, ids)
    model = cached_hf_model(tiny_qwen3_5)
    layers = model.model.language_model.layers
    # Recomputed here in another order: a norm or a projection sums over the hidden size, a residual adds two terms.
    over_hidden, residual = tolerance(torch.float32, H), tolerance(torch.float32, 2)

    assert cap.positions == list(range(T)) and cap.input_ids == ids
    assert cap.logits.shape == (T, V) and cap.logits.dtype == torch.float32
    assert int(cap.logits[-1].argmax()) == hf_greedy(tiny_qwen3_5, [ids], 1)[0][0]
    assert [layer.kind for layer in cap.layers] == t["layer_types"]
    for i, layer in enumerate(cap.layers):
        for name in ("layer_input", "mixer_input", "mixer_output", "mlp_input", "mlp_output", "layer_output"):
            assert getattr(layer, name).shape == (T, H), (i, name)
        # The decoder layer's algebra: pre-norm mixer and MLP, each added to the residual stream.
        eps = t["rms_norm_eps"]
        norm1, norm2 = layers[i].input_layernorm.weight, layers[i].post_attention_layernorm.weight
        assert_close(layer.mixer_input, rms_norm_zero_centred(layer.layer_input, norm1, eps), over_hidden)
        hidden = layer.layer_input + layer.mixer_output
        assert_close(layer.mlp_input, rms_norm_zero_centred(hidden, norm2, eps), over_hidden)
        assert_close(layer.layer_output, hidden + layer.mlp_output, residual)
        if i + 1 < len(cap.layers):
            # One tensor, recorded twice (a layer's output is the next layer's input): equal, bit for bit.
            assert torch.equal(layer.layer_output, cap.layers[i + 1].layer_input)
        if layer.kind == "full_attention":
            assert layer.keys.shape == layer.values.shape == (t["num_key_value_heads"], T, t["head_dim"])
            assert layer.conv_state is None and layer.recurrent_state is None
            # v_proj has neither norm nor RoPE: the cached values are the projection of the mixer input.
            v = layer.mixer_input @ layers[i].self_attn.v_proj.weight.T
            assert_close(layer.values, v.view(T, t["num_key_value_heads"], t["head_dim"]).transpose(0, 1), over_hidden)
        else:
            K = t["linear_conv_kernel_dim"]
            assert layer.conv_state.shape == (conv_dim, K)
            assert layer.recurrent_state.shape == (
                t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
            )
            assert layer.keys is None
            # The conv state holds the last K pre-conv inputs: in_proj_qkv of the last K tokens.
            qkv = layer.mixer_input @ layers[i].linear_attn.in_proj_qkv.weight.T
            assert_close(layer.conv_state, qkv[-K:].T, over_hidden)
    final_norm = model.model.language_model.norm.weight
    assert_close(
        cap.final_hidden, rms_norm_zero_centred(cap.layers[-1].layer_output, final_norm, t["rms_norm_eps"]), over_hidden
    )


def test_decode_capture_continues_the_prefill(tiny_qwen3_5):
    prompt = PROMPTS[0]
    prefill = hf_prefill_capture(tiny_qwen3_5, prompt)
    decode = hf_decode_capture(tiny_qwen3_5, prompt, next_token=123)
    full = hf_prefill_capture(tiny_qwen3_5, prompt + [123])
    assert decode.positions == [len(prompt)] and decode.input_ids == [123]
    assert decode.logits.shape == (1, preset_config("qwen3_5", "tiny")["text_config"]["vocab_size"])
    # One cached decode step gives what a fresh forward over prompt + token gives at its last position, up to the
    # order of the sums (the recurrence against the chunked form, attention over a cache against a prefill).
    allowed = tolerance(torch.float32, model_reduction_length(load_model_config(tiny_qwen3_5), len(prompt) + 1))
    assert_close(decode.logits[0], full.logits[-1], allowed, "logits")
    for i, (d, p, f) in enumerate(zip(decode.layers, prefill.layers, full.layers)):
        assert d.mixer_output.shape == (1, prefill.layers[0].mixer_output.shape[1])
        assert_close(d.layer_output[0], f.layer_output[-1], allowed, f"layer {i} output")
        # The decode step's cache continues the one its own prefill left, which computed what prefill_capture
        # computed (the same operations on the same input): equal, bit for bit.
        if d.kind == "full_attention":
            assert d.keys.shape[1] == len(prompt) + 1
            assert torch.equal(d.keys[:, :-1], p.keys)
        else:
            # The conv window slid by one: its first K-1 columns are the prefill's last K-1.
            assert torch.equal(d.conv_state[:, :-1], p.conv_state[:, 1:])
            assert_close(d.recurrent_state, f.recurrent_state, allowed, f"layer {i} recurrent state")


def test_capture_on_qwen3_and_moe(tiny_qwen3, tiny_qwen3_5_moe):
    cap = hf_prefill_capture(tiny_qwen3, PROMPTS[1])
    cfg = preset_config("qwen3", "tiny")
    assert [layer.kind for layer in cap.layers] == ["full_attention"] * cfg["num_hidden_layers"]
    assert cap.layers[0].keys.shape == (cfg["num_key_value_heads"], 3, cfg["head_dim"])
    moe = hf_prefill_capture(tiny_qwen3_5_moe, PROMPTS[1])
    t = preset_config("qwen3_5_moe", "tiny")["text_config"]
    model = cached_hf_model(tiny_qwen3_5_moe)
    for i, layer in enumerate(moe.layers):
        assert layer.router_logits.shape == (3, t["num_experts"])
        router = model.model.language_model.layers[i].mlp.gate.weight
        assert_close(layer.router_logits, layer.mlp_input @ router.T, tolerance(torch.float32, t["hidden_size"]))
