"""Checkpoints without a hub: random-weight checkpoint directories in the exact format of the real ones.

`make_checkpoint(path, arch, preset=..., seed=..., **text_config_overrides)` writes what a downloaded checkpoint
holds: `config.json`, `generation_config.json`, two or more safetensors shards and `model.safetensors.index.json`.
The configs come from `a4/presets/<arch>-<preset>.json` (real configs, and `tiny` ones for tests); the tensor names
and shapes come from this module's own description of each format (not from transformers), and
transformers' `from_pretrained` proves that they load: tests check that nothing is missing.

Architectures (`arch`):
- `qwen3`: Qwen3ForCausalLM, every layer full attention, flat config.json.
- `qwen3_5`: Qwen3_5ForConditionalGeneration: `model.language_model.*` (Gated DeltaNet + gated attention layers),
  a vision tower `model.visual.*` (unused by a4, present because real checkpoints carry it), the
  multi-token-prediction module `mtp.*` (random weights; a4.models.qwen3_5_mtp loads it apart from the main model),
  `lm_head.weight` only when embeddings are untied.
- `qwen3_5_moe`: Qwen3_5MoeForConditionalGeneration: as `qwen3_5`, with sparse MoE MLPs whose experts are stored
  fused (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]); its MTP layer
  stores experts one by one, as the real checkpoint does.

Weights are random but chosen so that token-by-token checks mean something (transformers' own init would give
near-constant output: zero norms, tiny embeddings). Every tensor is drawn from its own `torch.Generator`, seeded by
(seed, tensor name), so a tensor does not depend on which other tensors exist. Scales (H = input features):
- linear weights N(0, 1/H): every projection keeps activations at unit scale whatever the width;
- embeddings and untied `lm_head` N(0, 1/H) too: logits are O(1) whether or not embeddings are tied, and the
  embedding stays small next to the sublayer outputs (a dominant embedding in the residual stream makes a tied
  model repeat its last token);
- zero-centred RMSNorms (Qwen3.5: scale = 1 + w) store w ~ N(0, 0.1²); plain RMSNorms (Qwen3 and the GDN output
  norm, scale = w) store 1 + N(0, 0.1²): a wrong "1 +" or a forgotten weight changes the output visibly;
- q_norm/k_norm scale ~2 (Qwen3 w ~ N(2, 0.1²), Qwen3.5 w ~ N(1, 0.1²)): sharper attention, so the next token
  depends on the context and greedy continuations do not fall into short cycles;
- GDN decay: `A_log` = log(U(0.05, 0.8)), `dt_bias` ~ U(-1.5, 0.5); with a ~ N(0, 1) from `in_proj_a` the per-token
  decay exp(-A·softplus(a + dt_bias)) spreads over about (0.3, 0.995): neither ~0 (no memory) nor ~1 (no forgetting);
- GDN conv1d N(0, 1/kernel); vision tower: LayerNorms 1 + N(0, 0.1²), biases N(0, 0.02²).
All tensors are stored in bfloat16, as the real checkpoints are, so float32 and bfloat16 runs read the same values.

After writing a `tiny` checkpoint the factory runs it in transformers (two random prompts, ten greedy tokens each,
float32) and keeps it only if at least 40% of each continuation's tokens are distinct and the median top-1/top-2
logit gap is above 1e-3 (measured: ~0.2 for every tiny preset, tied or not). Some draws of a legal shape fall short
(about one in ten for the 2-layer shape of transformers' own Qwen3.5 tests): the factory then draws again with seed
+ 1, + 2, ... and keeps the first that passes, so the same arguments always give the same weights. Only when
`QUALITY_SEED_TRIES` seeds all fail does it raise `CheckpointQualityError`, saying what to change.
Real-size presets skip that check. Their vision tower has the real shape too (for `0.8b`: ~100M parameters).

Overriding `vocab_size` moves every special token id (`*_token_id`) with the end of the vocabulary, where the presets
keep them, so that eos stays a token the model can emit. An override of `rope_parameters` is merged into the
preset's (transformers' own tests give no partial_rotary_factor, and transformers then takes 0.25, as the preset).

One checkpoint is trained, not drawn: `tiny_checkpoint("qwen3_5", trained=True)` is the tiny Qwen3.5 that ships in
`a4/trained/qwen3_5-tiny/` with its tokenizer, written by `python -m a4.train_tiny` (which takes its configs from
`resolved_configs` and its unused vision tower from `random_tensors`).

`make_checkpoint(..., weights=False)` writes the two configs alone (no safetensors, no index): the directory of a
model too large for the disk, whose weights `load_model(..., load_format="dummy")` draws in device memory from the
same tensor plan (`tensor_plan`, `draw_tensor`, seed 0). On the CPU those are the weights that
`make_checkpoint(..., seed=0, verify=False)` writes; a GPU's generator draws others of the same distribution.

With `path=None` checkpoints are cached under `<repo>/.cache/checkpoints/<arch>-<preset>-<hash of all arguments>/`
(`A4_CACHE_DIR` replaces `<repo>/.cache`). Writing goes to a temporary directory that is renamed into place, so two
pytest workers building the same checkpoint at once both end up with one complete copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from a4._overlay import REPO_ROOT

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
# The trained tiny Qwen3.5 that ships with the package (written by a4/train_tiny.py).
TRAINED_DIR = Path(__file__).resolve().parent / "trained" / "qwen3_5-tiny"
# Bump when the weights or layout this module writes change, so that stale cached checkpoints are not reused.
FORMAT_VERSION = 3
# Largest shard written; the factory also splits small checkpoints in two, so every checkpoint has an index.
MAX_SHARD_BYTES = 1 << 30
STORAGE_DTYPE = torch.bfloat16

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# Quality bar of the post-write check of tiny checkpoints (float32, greedy).
MIN_DISTINCT_FRACTION = 0.4
MIN_MEDIAN_TOP2_GAP = 1e-3
# Seeds tried (seed, seed + 1, ...) before a tiny checkpoint's quality check gives up.
QUALITY_SEED_TRIES = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be built: unknown architecture or preset, inconsistent overrides."""


class CheckpointQualityError(RuntimeError):
    """A tiny checkpoint shape whose random weights, for every seed tried, make token-by-token checks meaningless."""


# ----------------------------------------------------------------------------------------------------------- presets


def preset_path(arch: str, preset: str) -> Path:
    """The config.json of a preset: `a4/presets/<arch>-<preset>.json` (its generation config sits beside it)."""
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"unknown architecture {arch!r} (known: {sorted(ARCHITECTURES)})")
    path = PRESETS_DIR / f"{arch}-{preset}.json"
    if not path.exists():
        configs = [p for p in PRESETS_DIR.glob(f"{arch}-*.json") if not p.name.endswith(".generation_config.json")]
        known = sorted(p.stem.split("-", 1)[1] for p in configs)
        raise CheckpointError(f"no preset {preset!r} for {arch} (known: {known})")
    return path


def preset_config(arch: str, preset: str) -> dict[str, Any]:
    """A preset's config.json contents (a fresh copy)."""
    return json.loads(preset_path(arch, preset).read_text())


def preset_generation_config(arch: str, preset: str) -> dict[str, Any]:
    return json.loads(preset_path(arch, preset).with_suffix(".generation_config.json").read_text())


def _default_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's pattern: full attention on every fourth layer, Gated DeltaNet elsewhere."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def _mrope_section(rotary_dim: int) -> list[int]:
    """Split rotary_dim/2 frequencies over (t, h, w) in the real checkpoints' 11:11:10 proportion."""
    half = rotary_dim // 2
    t = h = round(half * 11 / 32)
    return [t, h, half - t - h]


def _id_list(value: int | list[int]) -> list[int]:
    return value if isinstance(value, list) else [value]


def _move_special_tokens(sections: list[dict[str, Any]], old_vocab: int, new_vocab: int) -> None:
    """Shift every `*_token_id` of `sections` by new_vocab - old_vocab: special tokens stay at the vocabulary's end."""
    special = [
        (section, key) for section in sections for key, value in section.items()
        if key.endswith("_token_id") and value is not None
    ]
    needed = max((old_vocab - i for section, key in special for i in _id_list(section[key])), default=0)
    if new_vocab < needed:
        raise CheckpointError(
            f"vocab_size {new_vocab} is too small for the preset's special tokens, which take the last {needed} ids "
            f"of its vocabulary: use at least {needed}"
        )
    for section, key in special:
        moved = [i + new_vocab - old_vocab for i in _id_list(section[key])]
        section[key] = moved if isinstance(section[key], list) else moved[0]


def resolved_configs(
    arch: str, preset: str = "tiny", **text_config_overrides: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and generation_config.json of a preset with these text-config overrides, derived fields followed
    (what make_checkpoint writes)."""
    return _apply_overrides(
        arch, preset_config(arch, preset), preset_generation_config(arch, preset), text_config_overrides
    )


def _apply_overrides(
    arch: str, config: dict[str, Any], generation: dict[str, Any], overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """config and generation config with text-config fields replaced; derived fields (layer_types, mrope_section,
    tying, special token ids) follow."""
    config, generation = copy.deepcopy(config), copy.deepcopy(generation)
    text = config if arch == "qwen3" else config["text_config"]
    unknown = sorted(set(overrides) - set(text))
    if unknown:
        # A misspelt field would otherwise give the preset's shapes silently.
        raise CheckpointError(f"unknown text-config field(s) {unknown} for {arch}")
    preset_vocab = text["vocab_size"]
    preset_rope = text.get("rope_parameters")
    text.update(copy.deepcopy(overrides))
    if "vocab_size" in overrides:
        sections = [config, generation] + ([] if text is config else [text])
        _move_special_tokens(sections, preset_vocab, text["vocab_size"])
    if arch == "qwen3":
        return config, generation
    if "rope_parameters" in overrides:
        text["rope_parameters"] = {**preset_rope, **text["rope_parameters"]}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        text["layer_types"] = _default_layer_types(text["num_hidden_layers"])
    if "layer_types" in overrides and "num_hidden_layers" not in overrides:
        text["num_hidden_layers"] = len(text["layer_types"])
    if len(text["layer_types"]) != text["num_hidden_layers"]:
        raise CheckpointError(
            f"layer_types has {len(text['layer_types'])} entries but num_hidden_layers is {text['num_hidden_layers']}"
        )
    if text["linear_num_value_heads"] % text["linear_num_key_heads"]:
        raise CheckpointError(
            f"linear_num_value_heads ({text['linear_num_value_heads']}) must be a multiple of "
            f"linear_num_key_heads ({text['linear_num_key_heads']})"
        )
    rope = text["rope_parameters"]
    rotary_dim = int(text["head_dim"] * rope["partial_rotary_factor"])
    if rotary_dim % 2 or rotary_dim == 0:
        raise CheckpointError(f"head_dim {text['head_dim']} x partial_rotary_factor gives odd rotary dim {rotary_dim}")
    if sum(rope["mrope_section"]) != rotary_dim // 2:
        rope["mrope_section"] = _mrope_section(rotary_dim)
    # transformers ties by the top-level flag; real files carry the same value in both places.
    config["tie_word_embeddings"] = text["tie_word_embeddings"]
    if config["vision_config"]["out_hidden_size"] != text["hidden_size"]:
        config["vision_config"]["out_hidden_size"] = text["hidden_size"]
    return config, generation


# ------------------------------------------------------------------------------------------------------ tensor plan

Init = Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]


# Each Init draws on its generator's device: the same plan fills a model on a GPU (a4.models.weights.draw_weights).
def normal(std: float, mean: float = 0.0) -> Init:
    return lambda gen, shape: torch.randn(shape, generator=gen, device=gen.device) * std + mean


def uniform(low: float, high: float) -> Init:
    return lambda gen, shape: torch.rand(shape, generator=gen, device=gen.device) * (high - low) + low


def log_uniform_values(low: float, high: float) -> Init:
    """log(U(low, high)): A_log, whose exp is the per-head decay rate A."""
    return lambda gen, shape: (torch.rand(shape, generator=gen, device=gen.device) * (high - low) + low).log()


def fan_in(in_features: int) -> Init:
    return normal(1.0 / math.sqrt(in_features))


ZERO_CENTRED_NORM = normal(0.1)
PLAIN_NORM = normal(0.1, mean=1.0)
# q_norm/k_norm scale about 2: attention scores of std ~4 instead of ~1. With diffuse attention a random model's
# next token depends mostly on the last token, and greedy decoding falls into short cycles.
QK_NORM = normal(0.1, mean=2.0)
QK_ZERO_CENTRED_NORM = normal(0.1, mean=1.0)
BIAS = normal(0.02)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Init

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * STORAGE_DTYPE.itemsize


def _linear(name: str, out_features: int, in_features: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (out_features, in_features), fan_in(in_features))


def _dense_mlp(prefix: str, hidden: int, intermediate: int) -> Iterator[TensorSpec]:
    yield _linear(f"{prefix}.gate_proj", intermediate, hidden)
    yield _linear(f"{prefix}.up_proj", intermediate, hidden)
    yield _linear(f"{prefix}.down_proj", hidden, intermediate)


def _qwen3_tensors(cfg: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    yield TensorSpec("model.embed_tokens.weight", (cfg["vocab_size"], hidden), fan_in(hidden))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield TensorSpec(f"{p}.input_layernorm.weight", (hidden,), PLAIN_NORM)
        yield _linear(f"{p}.self_attn.q_proj", n_heads * head_dim, hidden)
        yield _linear(f"{p}.self_attn.k_proj", n_kv * head_dim, hidden)
        yield _linear(f"{p}.self_attn.v_proj", n_kv * head_dim, hidden)
        yield _linear(f"{p}.self_attn.o_proj", hidden, n_heads * head_dim)
        yield TensorSpec(f"{p}.self_attn.q_norm.weight", (head_dim,), QK_NORM)
        yield TensorSpec(f"{p}.self_attn.k_norm.weight", (head_dim,), QK_NORM)
        yield TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), PLAIN_NORM)
        yield from _dense_mlp(f"{p}.mlp", hidden, cfg["intermediate_size"])
    yield TensorSpec("model.norm.weight", (hidden,), PLAIN_NORM)
    if not cfg["tie_word_embeddings"]:
        yield _linear("lm_head", cfg["vocab_size"], hidden)


def _gated_attention(prefix: str, t: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, head_dim = t["hidden_size"], t["head_dim"]
    n_heads, n_kv = t["num_attention_heads"], t["num_key_value_heads"]
    # Per head: head_dim query rows then head_dim gate rows.
    yield _linear(f"{prefix}.q_proj", 2 * n_heads * head_dim, hidden)
    yield _linear(f"{prefix}.k_proj", n_kv * head_dim, hidden)
    yield _linear(f"{prefix}.v_proj", n_kv * head_dim, hidden)
    yield _linear(f"{prefix}.o_proj", hidden, n_heads * head_dim)
    yield TensorSpec(f"{prefix}.q_norm.weight", (head_dim,), QK_ZERO_CENTRED_NORM)
    yield TensorSpec(f"{prefix}.k_norm.weight", (head_dim,), QK_ZERO_CENTRED_NORM)


def _gated_deltanet(prefix: str, t: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, kernel = t["hidden_size"], t["linear_conv_kernel_dim"]
    n_v, d_v = t["linear_num_value_heads"], t["linear_value_head_dim"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    conv_dim = 2 * key_dim + n_v * d_v
    yield _linear(f"{prefix}.in_proj_qkv", conv_dim, hidden)
    yield _linear(f"{prefix}.in_proj_z", n_v * d_v, hidden)
    yield _linear(f"{prefix}.in_proj_b", n_v, hidden)
    yield _linear(f"{prefix}.in_proj_a", n_v, hidden)
    yield TensorSpec(f"{prefix}.conv1d.weight", (conv_dim, 1, kernel), fan_in(kernel))
    yield TensorSpec(f"{prefix}.dt_bias", (n_v,), uniform(-1.5, 0.5))
    yield TensorSpec(f"{prefix}.A_log", (n_v,), log_uniform_values(0.05, 0.8))
    yield TensorSpec(f"{prefix}.norm.weight", (d_v,), PLAIN_NORM)
    yield _linear(f"{prefix}.out_proj", hidden, n_v * d_v)


def _sparse_moe(prefix: str, t: dict[str, Any], fused_experts: bool) -> Iterator[TensorSpec]:
    hidden, n_experts, inter = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"]
    yield TensorSpec(f"{prefix}.gate.weight", (n_experts, hidden), fan_in(hidden))
    if fused_experts:
        yield TensorSpec(f"{prefix}.experts.gate_up_proj", (n_experts, 2 * inter, hidden), fan_in(hidden))
        yield TensorSpec(f"{prefix}.experts.down_proj", (n_experts, hidden, inter), fan_in(inter))
    else:
        for e in range(n_experts):
            yield from _dense_mlp(f"{prefix}.experts.{e}", hidden, inter)
    yield from _dense_mlp(f"{prefix}.shared_expert", hidden, t["shared_expert_intermediate_size"])
    yield _linear(f"{prefix}.shared_expert_gate", 1, hidden)


def _decoder_layer(prefix: str, t: dict[str, Any], kind: str, moe: bool, fused_experts: bool) -> Iterator[TensorSpec]:
    hidden = t["hidden_size"]
    yield TensorSpec(f"{prefix}.input_layernorm.weight", (hidden,), ZERO_CENTRED_NORM)
    if kind == "full_attention":
        yield from _gated_attention(f"{prefix}.self_attn", t)
    elif kind == "linear_attention":
        yield from _gated_deltanet(f"{prefix}.linear_attn", t)
    else:
        raise CheckpointError(f"{prefix}: unknown layer type {kind!r}")
    yield TensorSpec(f"{prefix}.post_attention_layernorm.weight", (hidden,), ZERO_CENTRED_NORM)
    if moe:
        yield from _sparse_moe(f"{prefix}.mlp", t, fused_experts)
    else:
        yield from _dense_mlp(f"{prefix}.mlp", hidden, t["intermediate_size"])


def _vision_tower(prefix: str, v: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, inter = v["hidden_size"], v["intermediate_size"]
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    merged = hidden * v["spatial_merge_size"] ** 2

    def linear_with_bias(name: str, out_features: int, in_features: int) -> Iterator[TensorSpec]:
        yield _linear(name, out_features, in_features)
        yield TensorSpec(f"{name}.bias", (out_features,), BIAS)

    def layer_norm(name: str, width: int) -> Iterator[TensorSpec]:
        yield TensorSpec(f"{name}.weight", (width,), PLAIN_NORM)
        yield TensorSpec(f"{name}.bias", (width,), BIAS)

    patch_shape = (hidden, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    yield TensorSpec(f"{prefix}.patch_embed.proj.weight", patch_shape, fan_in(patch_in))
    yield TensorSpec(f"{prefix}.patch_embed.proj.bias", (hidden,), BIAS)
    yield TensorSpec(f"{prefix}.pos_embed.weight", (v["num_position_embeddings"], hidden), BIAS)
    for i in range(v["depth"]):
        p = f"{prefix}.blocks.{i}"
        yield from layer_norm(f"{p}.norm1", hidden)
        yield from linear_with_bias(f"{p}.attn.qkv", 3 * hidden, hidden)
        yield from linear_with_bias(f"{p}.attn.proj", hidden, hidden)
        yield from layer_norm(f"{p}.norm2", hidden)
        yield from linear_with_bias(f"{p}.mlp.linear_fc1", inter, hidden)
        yield from linear_with_bias(f"{p}.mlp.linear_fc2", hidden, inter)
    yield from layer_norm(f"{prefix}.merger.norm", hidden)
    yield from linear_with_bias(f"{prefix}.merger.linear_fc1", merged, merged)
    yield from linear_with_bias(f"{prefix}.merger.linear_fc2", v["out_hidden_size"], merged)


def _qwen3_5_tensors(config: dict[str, Any], moe: bool) -> Iterator[TensorSpec]:
    t = config["text_config"]
    hidden = t["hidden_size"]
    lm = "model.language_model"
    yield TensorSpec(f"{lm}.embed_tokens.weight", (t["vocab_size"], hidden), fan_in(hidden))
    for i, kind in enumerate(t["layer_types"]):
        yield from _decoder_layer(f"{lm}.layers.{i}", t, kind, moe, fused_experts=True)
    yield TensorSpec(f"{lm}.norm.weight", (hidden,), ZERO_CENTRED_NORM)
    if not config["tie_word_embeddings"]:
        yield _linear("lm_head", t["vocab_size"], hidden)
    yield from _vision_tower("model.visual", config["vision_config"])
    # MTP: fc(cat(norm_emb(embedding), norm_hidden(hidden))) -> one full-attention layer -> norm; it reuses the
    # main embedding and lm_head.
    yield _linear("mtp.fc", hidden, 2 * hidden)
    yield TensorSpec("mtp.pre_fc_norm_embedding.weight", (hidden,), ZERO_CENTRED_NORM)
    yield TensorSpec("mtp.pre_fc_norm_hidden.weight", (hidden,), ZERO_CENTRED_NORM)
    for i in range(t.get("mtp_num_hidden_layers", 1)):
        yield from _decoder_layer(f"mtp.layers.{i}", t, "full_attention", moe, fused_experts=False)
    yield TensorSpec("mtp.norm.weight", (hidden,), ZERO_CENTRED_NORM)


def arch_of(architecture: str) -> str:
    """The `arch` whose checkpoints name this class in config.json's `architectures` (ARCHITECTURES read backwards)."""
    for arch, name in ARCHITECTURES.items():
        if name == architecture:
            return arch
    raise CheckpointError(
        f"no tensor plan for architecture {architecture!r} (known: {sorted(ARCHITECTURES.values())})"
    )


def tensor_plan(arch: str, config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of a checkpoint of `arch` with this config.json: name, shape and how it is drawn."""
    if arch == "qwen3":
        return list(_qwen3_tensors(config))
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return list(_qwen3_5_tensors(config, moe=arch == "qwen3_5_moe"))
    raise CheckpointError(f"unknown architecture {arch!r} (known: {sorted(ARCHITECTURES)})")


def draw_tensor(spec: TensorSpec, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor of the plan in STORAGE_DTYPE, drawn on `device` by a generator seeded by (seed, its name).

    On the CPU this is the tensor make_checkpoint writes, bit for bit, where torch runs the same CPU kernels (its
    normal sampler rounds otherwise on another vector width, e.g. under ATEN_CPU_CAPABILITY=default). A GPU's
    generator (Philox) draws other values of the same distribution.
    """
    digest = hashlib.sha256(f"{seed}/{spec.name}".encode()).digest()
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return spec.init(gen, spec.shape).to(STORAGE_DTYPE)


def random_tensors(arch: str, config: dict[str, Any], seed: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """The random tensors of a checkpoint of `arch` whose names start with `prefix`, as make_checkpoint draws them."""
    return {spec.name: draw_tensor(spec, seed) for spec in tensor_plan(arch, config) if spec.name.startswith(prefix)}


# ------------------------------------------------------------------------------------------------------------ write


def _shards(plan: list[TensorSpec]) -> list[list[TensorSpec]]:
    """Consecutive groups of at most MAX_SHARD_BYTES each, and at least two groups (real checkpoints are sharded)."""
    total = sum(spec.nbytes for spec in plan)
    limit = min(MAX_SHARD_BYTES, math.ceil(total / 2))
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in plan:
        if shards[-1] and size + spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _write_files(directory: Path, arch: str, config: dict[str, Any], generation: dict[str, Any], seed: int) -> None:
    plan = tensor_plan(arch, config)
    shards = _shards(plan)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        # One shard in memory at a time: real-size checkpoints never hold the whole model.
        tensors = {spec.name: draw_tensor(spec, seed) for spec in shard}
        save_file(tensors, directory / filename, metadata={"format": "pt"})
        weight_map.update({spec.name: filename for spec in shard})
    total_size = sum(spec.nbytes for spec in plan)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_configs(directory, config, generation)


def _write_configs(directory: Path, config: dict[str, Any], generation: dict[str, Any]) -> None:
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def cache_root() -> Path:
    return Path(os.environ.get("A4_CACHE_DIR") or REPO_ROOT / ".cache") / "checkpoints"


def _cache_key(**args: Any) -> str:
    """A short hash of everything that decides a checkpoint's files, and of FORMAT_VERSION."""
    # The resolved configs are part of the key, so editing a preset file invalidates its cached checkpoints; so is
    # `verify`, since a checked checkpoint may hold a later seed's weights.
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **args}, sort_keys=True).encode()).hexdigest()[:12]


def make_checkpoint(
    path: str | Path | None,
    arch: str,
    *,
    preset: str = "tiny",
    seed: int = 0,
    verify: bool | None = None,
    weights: bool = True,
    **text_config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint directory and return its path.

    path: where to write it (must not exist yet, or be an empty directory); None for the shared cache, where an
        existing checkpoint built from the same arguments is reused.
    arch: "qwen3", "qwen3_5" or "qwen3_5_moe". preset: "tiny" or a real size (see `a4/presets/`).
    text_config_overrides: text-config fields to change (num_hidden_layers, layer_types, head_dim, ...). Overriding
        num_hidden_layers alone re-derives layer_types (full attention where (i + 1) % 4 == 0).
    verify: run the quality check in transformers after writing, moving on to seed + 1, + 2, ... while it fails;
        default: only for the tiny preset.
    weights: False writes config.json and generation_config.json alone, for `load_format="dummy"`, which draws
        seed 0's weights on the device; `seed` and `verify`, which choose weights, must then keep their defaults.
    """
    config, generation = resolved_configs(arch, preset, **text_config_overrides)
    if not weights and (seed != 0 or verify):
        raise CheckpointError(
            f"weights=False writes no weights, so seed={seed} and verify={verify} choose nothing: "
            "load_format='dummy' draws the weights of seed 0, unverified"
        )
    verify = weights and preset == "tiny" if verify is None else verify
    if path is None:
        # Only a config-only directory adds `weights` to the key: it never shadows the full checkpoint of the same
        # arguments, and the keys of the full checkpoints already cached stay what they were.
        key = _cache_key(
            arch=arch, preset=preset, seed=seed, verify=verify, overrides=text_config_overrides, config=config,
            generation=generation, **({} if weights else {"weights": False}),
        )
        target = cache_root() / f"{arch}-{preset}-{key}"
        if (target / "config.json").exists():
            return target
    else:
        target = Path(path)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise CheckpointError(f"{target} already exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    try:
        if not weights:
            _write_configs(staging, config, generation)
        elif verify:
            _write_first_varied(staging, arch, config, generation, seed)
        else:
            _write_files(staging, arch, config, generation, seed)
        if target.is_dir() and path is not None:
            target.rmdir()
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its copy first (same arguments, same files): keep theirs.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_checkpoint(arch: str, trained: bool = False, **text_config_overrides: Any) -> Path:
    """The cached tiny checkpoint of `arch` (seed 0) with these overrides: what tests use.

    trained=True: the trained tiny Qwen3.5 that ships in the package (a4/trained/qwen3_5-tiny, written by
    `python -m a4.train_tiny`), with its tokenizer; it has no overrides.
    """
    if not trained:
        return make_checkpoint(None, arch, **text_config_overrides)
    if arch != "qwen3_5" or text_config_overrides:
        raise CheckpointError(
            f"the trained tiny checkpoint is qwen3_5 without overrides (asked: {arch} with {text_config_overrides})"
        )
    if not (TRAINED_DIR / "config.json").exists():
        raise CheckpointError(f"{TRAINED_DIR} is missing: run `python -m a4.train_tiny` to write it")
    return TRAINED_DIR


# ---------------------------------------------------------------------------------------------------- quality check


@dataclass(frozen=True)
class QualityReport:
    distinct_fraction: float  # distinct tokens / generated tokens, the worst prompt
    median_top2_gap: float  # median over all greedy steps of top-1 minus top-2 logit (float32)

    @property
    def passes(self) -> bool:
        return self.distinct_fraction >= MIN_DISTINCT_FRACTION and self.median_top2_gap >= MIN_MEDIAN_TOP2_GAP


def measure_quality(
    model_dir: str | Path, num_prompts: int = 2, prompt_len: int = 6, new_tokens: int = 10
) -> QualityReport:
    """Greedy continuations of random prompts in transformers (float32, no eos stop), one cached forward per token."""
    from transformers import DynamicCache

    from a4.reference import load_hf_model  # transformers is only needed here

    model = load_hf_model(model_dir, "float32")
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1234)
    distinct, gaps = [], []
    with torch.no_grad():
        for _ in range(num_prompts):
            cache = DynamicCache(config=model.config)
            step_ids = torch.randint(0, vocab, (1, prompt_len), generator=gen)
            generated = []
            for _ in range(new_tokens):
                logits = model(input_ids=step_ids, cache=cache, use_cache=True).logits[0, -1].float()
                top2 = logits.topk(2).values
                gaps.append((top2[0] - top2[1]).item())
                generated.append(int(logits.argmax()))
                step_ids = torch.tensor([[generated[-1]]])
            distinct.append(len(set(generated)) / new_tokens)
    return QualityReport(distinct_fraction=min(distinct), median_top2_gap=float(torch.tensor(gaps).median()))


def _write_first_varied(
    directory: Path, arch: str, config: dict[str, Any], generation: dict[str, Any], seed: int
) -> None:
    """Write the checkpoint of the first of seed, seed + 1, ... whose greedy output passes the quality bar."""
    failed: dict[int, QualityReport] = {}
    for candidate in range(seed, seed + QUALITY_SEED_TRIES):
        _write_files(directory, arch, config, generation, candidate)
        report = measure_quality(directory)
        if report.passes:
            return
        failed[candidate] = report
    listing = "".join(
        f"\n  seed {s}: distinct fraction {r.distinct_fraction:.2g}, median top-1/top-2 gap {r.median_top2_gap:.2g}"
        for s, r in failed.items()
    )
    raise CheckpointQualityError(
        f"random weights of this {arch} shape give degenerate greedy output for every seed tried (need distinct "
        f"fraction >= {MIN_DISTINCT_FRACTION} and median gap >= {MIN_MEDIAN_TOP2_GAP}):{listing}\n"
        f"Try seed={seed + QUALITY_SEED_TRIES} or a wider or deeper shape (hidden_size, num_hidden_layers); or pass "
        f"verify=False to keep seed {seed}'s weights, on which token-by-token checks prove less."
    )
