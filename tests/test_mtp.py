"""a4's Qwen3.5 MTP module (a4.models.qwen3_5_mtp) against a naive implementation of the checkpoint's layout, and
its loading.

transformers has no MTP module, so the reference is written here from the layout alone
(/work/shared/reference/qwen3_5-configs.md): plain torch ops in float64, the tensors read straight from the
safetensors files, the config from config.json, attention over the whole sequence under a causal mask (no KV pool).
The MoE checkpoint's MTP layer (its experts stored one by one) has its MLP computed by transformers' own
Qwen3_5MoeSparseMoeBlock in float64, holding those tensors.
Both sides get the same main-model hidden states, from transformers (the text model's last hidden state, after its
final norm: what lm_head reads). Position by position: a4's module runs through its KV pool layer in chunks, a
varlen batch and decode steps, and its logits at every position must match the reference's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from a4.checkpoints import tiny_checkpoint
from a4.course.checks._harness import (
    assert_close,
    attention_reduction_length,
    mlp_reduction_length,
    random_tokens,
    tolerance,
)
from a4.course.checks._model_runner import PAGE_SIZE, SlotTable, a4_model
from a4.kvcache.kv_pool import KVPool
from a4.models.qwen3_5_mtp import load_mtp
from a4.models.weights import WeightLoadError
from a4.reference import cached_hf_model

NUM_SLOTS = 2
MAX_CONTEXT = 64

# ------------------------------------------------------------------------------------------------ the naive reference


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in model_dir, by key."""
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    return tensors


def zero_centred_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def partial_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [T, heads, head_dim]: dims i and i + rotary_dim/2 of the first rotary_dim rotated by position * freq_i."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq  # [T, rotary_dim/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def naive_mtp_logits(model_dir: Path, hidden: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
    """The MTP logits [T, vocab] (float64) of one sequence: row i from the main model's final hidden state at
    position i and the token at position i + 1, attending causally to rows 0..i."""
    w = {key: t.double() for key, t in checkpoint_tensors(model_dir).items() if not key.startswith("model.visual.")}
    t = json.loads((model_dir / "config.json").read_text())["text_config"]
    eps, n_heads, n_kv, head_dim = t["rms_norm_eps"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    rope = t["rope_parameters"]
    rotary_dim = int(head_dim * rope["partial_rotary_factor"])
    embedding = w["model.language_model.embed_tokens.weight"]
    lm_head = w.get("lm_head.weight", embedding)  # tied checkpoints store only the embedding
    T = len(next_ids)
    positions = torch.arange(T)

    def norm(x: torch.Tensor, key: str) -> torch.Tensor:
        return zero_centred_norm(x, w[key], eps)

    embedded = norm(embedding[next_ids], "mtp.pre_fc_norm_embedding.weight")
    x = torch.cat((embedded, norm(hidden.double(), "mtp.pre_fc_norm_hidden.weight")), dim=-1) @ w["mtp.fc.weight"].T

    p = "mtp.layers.0."
    a = norm(x, p + "input_layernorm.weight")
    q_and_gate = (a @ w[p + "self_attn.q_proj.weight"].T).view(T, n_heads, 2 * head_dim)
    q, gate = q_and_gate[..., :head_dim], q_and_gate[..., head_dim:]
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(T, n_kv, head_dim)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, n_kv, head_dim)
    q = partial_rope(norm(q, p + "self_attn.q_norm.weight"), positions, rotary_dim, rope["rope_theta"])
    k = partial_rope(norm(k, p + "self_attn.k_norm.weight"), positions, rotary_dim, rope["rope_theta"])
    k, v = k.repeat_interleave(n_heads // n_kv, dim=1), v.repeat_interleave(n_heads // n_kv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + attended.reshape(T, n_heads * head_dim) @ w[p + "self_attn.o_proj.weight"].T

    m = norm(x, p + "post_attention_layernorm.weight")
    if "num_experts" in t:
        with torch.no_grad():
            x = x + transformers_moe_block(model_dir, w, p + "mlp.")(m[None])[0]
    else:
        gated = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
        x = x + gated @ w[p + "mlp.down_proj.weight"].T
    return norm(x, "mtp.norm.weight") @ lm_head.T


def transformers_moe_block(model_dir: Path, w: dict[str, torch.Tensor], prefix: str) -> torch.nn.Module:
    """transformers' Qwen3_5MoeSparseMoeBlock ("eager" experts, float64) holding the tensors under `prefix`: the
    checkpoint's experts one by one, stacked as transformers' fused experts read them (expert e's gate_up_proj is
    its gate_proj rows, then its up_proj rows)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = AutoConfig.from_pretrained(model_dir).text_config
    config._experts_implementation = "eager"
    block = Qwen3_5MoeSparseMoeBlock(config).double().eval()

    def expert(e: int, projection: str) -> torch.Tensor:
        return w[f"{prefix}experts.{e}.{projection}.weight"]

    experts = range(config.num_experts)
    state = {key.removeprefix(prefix): t for key, t in w.items() if key.startswith(prefix) and ".experts." not in key}
    gate_up = [torch.cat((expert(e, "gate_proj"), expert(e, "up_proj"))) for e in experts]
    state["experts.gate_up_proj"] = torch.stack(gate_up)
    state["experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in experts])
    block.load_state_dict(state)  # strict: every tensor of the block, nothing else
    return block


def hf_final_hidden(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' text model's last hidden state [n, hidden] (float32): after its final norm."""
    model = cached_hf_model(model_dir, "float32")
    with torch.no_grad():
        hidden = model.model.language_model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        # What lm_head reads: the hidden state the MTP module takes is the one the main model's logits come from.
        assert torch.equal(model.lm_head(hidden), model(torch.tensor([tokens])).logits[0])
    return hidden


# ------------------------------------------------------------------------------------------------------------ forward


@pytest.fixture(
    scope="module",
    params=[("qwen3_5", {}), ("qwen3_5", {"tie_word_embeddings": False}), ("qwen3_5_moe", {})],
    ids=["tied", "untied", "moe"],
)
def checkpoint(request) -> Path:
    arch, overrides = request.param
    return tiny_checkpoint(arch, **overrides)


def test_mtp_logits_match_naive_layout_position_by_position(checkpoint):
    """Two requests in slots 1 and 0 through the MTP's own KV pool layer: a varlen prefill, a second chunk for one
    while the other decodes, then decode steps of both; every row's logits against the naive full-sequence ones."""
    model = a4_model(checkpoint, torch.float32)
    mtp, _ = load_mtp(model, checkpoint, dtype=torch.float32, device="cpu")
    config = model.config
    sequences = {1: random_tokens(14, 40, config.vocab_size), 0: random_tokens(10, 41, config.vocab_size)}
    # MTP row i: the hidden state at position i and the token at i + 1 (the last token has no successor here).
    hidden = {slot: hf_final_hidden(checkpoint, seq)[:-1] for slot, seq in sequences.items()}
    next_ids = {slot: seq[1:] for slot, seq in sequences.items()}
    # Rows [a, b) of each slot's request per step: a varlen prefill; a second chunk beside a decode; decodes.
    steps = [{1: (0, 6), 0: (0, 4)}, {1: (6, 9), 0: (4, 5)}]
    steps += [{1: (i, i + 1), 0: (i - 4, i - 3)} for i in range(9, 13)]

    pool = KVPool(
        mtp.pool_layer + 1, NUM_SLOTS * MAX_CONTEXT // PAGE_SIZE, PAGE_SIZE, config.num_key_value_heads,
        config.head_dim, torch.float32, "cpu",
    )  # fmt: skip
    table = SlotTable(pool.num_locations, NUM_SLOTS, MAX_CONTEXT)
    logits: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in steps:
        rows = sum(b - a for a, b in step.values())
        fb = table.step({slot: next_ids[slot][a:b] for slot, (a, b) in step.items()}, pool, None, list(range(rows)))
        with torch.no_grad():
            out = mtp.logits(mtp(fb, torch.cat([hidden[slot][a:b] for slot, (a, b) in step.items()])))
        for slot, part in zip(step, out.split([b - a for a, b in step.values()])):
            logits[slot].append(part)

    allowed = tolerance(
        torch.float32,
        6 * config.hidden_size  # pre-fc norms, fc (2H), the layer's two norms, the final norm, lm_head
        + attention_reduction_length(config, MAX_CONTEXT)
        + mlp_reduction_length(config),
    )
    for slot in sequences:
        expected = naive_mtp_logits(checkpoint, hidden[slot], next_ids[slot])
        assert_close(torch.cat(logits[slot]), expected, allowed, f"MTP logits of the request in slot {slot}")


# ------------------------------------------------------------------------------------------------------------ loading


def test_load_mtp_fills_every_parameter_from_its_mtp_key_and_reads_nothing_else(tiny_qwen3_5):
    model = a4_model(tiny_qwen3_5, torch.float32)
    mtp, report = load_mtp(model, tiny_qwen3_5, dtype=torch.float32, device="cpu")
    stored = checkpoint_tensors(tiny_qwen3_5)
    mtp_keys = {key for key in stored if key.startswith("mtp.")}
    assert mtp_keys and set(report.loaded_keys) == mtp_keys
    assert set(report.skipped_keys) == stored.keys() - mtp_keys
    params = dict(mtp.named_parameters())
    assert {f"mtp.{name}" for name in params} == mtp_keys
    for key in mtp_keys:
        assert torch.equal(params[key.removeprefix("mtp.")], stored[key].float()), key
    # The embedding and lm_head are the main model's own tensors, not copies.
    embed_tokens, lm_head = mtp.shared
    assert embed_tokens.weight is model.model.embed_tokens.weight and lm_head.weight is model.lm_head.weight


def rewritten_checkpoint(source: Path, target: Path, edit) -> Path:
    """A copy of the checkpoint at `source` whose tensors are edit(tensors), in one file."""
    target.mkdir()
    for path in source.glob("*.json"):
        if path.name != "model.safetensors.index.json":
            shutil.copy(path, target)
    tensors = checkpoint_tensors(source)
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_load_mtp_names_each_wrong_missing_and_unexpected_key(tiny_qwen3_5, tmp_path):
    model = a4_model(tiny_qwen3_5, torch.float32)
    hidden = model.config.hidden_size

    def break_mtp(tensors: dict[str, torch.Tensor]) -> None:
        tensors["mtp.fc.weight"] = torch.zeros(hidden, 2 * hidden + 1, dtype=torch.bfloat16)
        del tensors["mtp.norm.weight"]
        tensors["mtp.layers.1.input_layernorm.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)

    broken = rewritten_checkpoint(tiny_qwen3_5, tmp_path / "broken", break_mtp)
    with pytest.raises(WeightLoadError) as error:
        load_mtp(model, broken, dtype=torch.float32, device="cpu")
    message = str(error.value)
    assert "3 problems" in message, message
    assert f"wrong shape: mtp.fc.weight is {(hidden, 2 * hidden + 1)}" in message, message
    assert "missing: norm.weight" in message, message
    assert "unexpected: mtp.layers.1.input_layernorm.weight" in message, message
    # The main model loads from the same file: its key map still skips every mtp.* key.
    assert a4_model(broken, torch.float32) is not None


def test_load_mtp_merges_the_moe_layers_experts_stored_one_by_one(tiny_qwen3_5_moe):
    """Every `mtp.*` key of the MoE checkpoint is read; the experts' one-by-one tensors land in the layer's fused
    ones, as the main layers store theirs (gate_up_proj[e] = gate_proj rows then up_proj rows; down_proj[e])."""
    model = a4_model(tiny_qwen3_5_moe, torch.float32)
    mtp, report = load_mtp(model, tiny_qwen3_5_moe, dtype=torch.float32, device="cpu")
    stored = {key: t.float() for key, t in checkpoint_tensors(tiny_qwen3_5_moe).items()}
    mtp_keys = {key for key in stored if key.startswith("mtp.")}
    assert set(report.loaded_keys) == mtp_keys and set(report.skipped_keys) == stored.keys() - mtp_keys
    experts = mtp.layers[0].mlp.experts
    num_experts = model.config.num_experts
    p = "mtp.layers.0.mlp.experts."
    expected_gate_up = [torch.cat((stored[f"{p}{e}.gate_proj.weight"], stored[f"{p}{e}.up_proj.weight"])) for e in
                        range(num_experts)]  # fmt: skip
    assert torch.equal(experts.gate_up_proj, torch.stack(expected_gate_up))
    assert torch.equal(experts.down_proj, torch.stack([stored[f"{p}{e}.down_proj.weight"] for e in range(num_experts)]))
    params = dict(mtp.named_parameters())
    assert set(params) == {key.removeprefix("mtp.") for key in mtp_keys if not key.startswith(p)} | {
        "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"}  # fmt: skip
    for key in mtp_keys:
        if not key.startswith(p):
            assert torch.equal(params[key.removeprefix("mtp.")], stored[key]), key
    # The same SparseMoeBlock as the main model's layers.
    assert type(mtp.layers[0].mlp) is type(model.model.layers[0].mlp)


def test_load_mtp_names_each_missing_or_misshapen_expert_of_a_moe_layer(tiny_qwen3_5_moe, tmp_path):
    model = a4_model(tiny_qwen3_5_moe, torch.float32)
    p = "mtp.layers.0.mlp.experts."

    def break_experts(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[f"{p}3.up_proj.weight"]
        tensors[f"{p}5.down_proj.weight"] = tensors[f"{p}5.down_proj.weight"].T.contiguous()

    broken = rewritten_checkpoint(tiny_qwen3_5_moe, tmp_path / "broken", break_experts)
    with pytest.raises(WeightLoadError) as error:
        load_mtp(model, broken, dtype=torch.float32, device="cpu")
    message = str(error.value)
    config = model.config
    assert "2 problems" in message, message
    assert "missing: layers.0.mlp.experts.3.up_proj.weight" in message, message
    wrong = (config.moe_intermediate_size, config.hidden_size)
    assert f"wrong shape: {p}5.down_proj.weight is {wrong}" in message, message


# ------------------------------------------------------------------------------------------- drafting in the engine


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_engines_first_draft_is_what_the_naive_mtp_predicts_from_the_committed_tokens(arch):
    """After every verify step the MTP module's KV must hold what the main model's true hidden states give at the
    committed positions, not the chained drafts' provisional values: its next first draft must then be the naive
    module's prediction over the whole committed sequence."""
    from a4 import LLM, SamplingParams

    checkpoint = tiny_checkpoint(arch)
    llm = LLM(checkpoint, speculative_tokens=2, max_prefill_tokens=16)
    drafter = llm.engine.drafter
    proposals = []
    propose = drafter.propose

    def recording(reqs, num_drafts):
        drafts = propose(reqs, num_drafts)
        proposals.extend((list(req.all_ids), d[0]) for req, d in zip(reqs, drafts) if d)
        return drafts

    drafter.propose = recording
    vocab = llm.engine.model_config.vocab_size
    llm.generate([random_tokens(3, 20, vocab), random_tokens(4, 7, vocab)], SamplingParams(max_new_tokens=8))
    assert len(proposals) >= 4
    for sequence, first_draft in proposals:
        # The last token has just been chosen and is not fed yet: the draft is read at the position before it.
        fed = len(sequence) - 1
        logits = naive_mtp_logits(checkpoint, hf_final_hidden(checkpoint, sequence[:fed]), sequence[1:])[-1]
        # The draft is the naive argmax, or ties with it within float32 rounding.
        assert logits[first_draft] >= logits.max() - 1e-4 * logits.abs().max(), (sequence, first_draft)
