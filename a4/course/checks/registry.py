"""The one table of the course's checks: every check cell's id, its notebook, the check function it calls, and whether
the assignment requires it.

Everything else that names checks follows this table: a notebook's check cells (their tag `check:<id>`, their
`with checking("<id>"):` and the check function they call, in this order; verify-notebooks lints all three against
it), grade's groups (`group_of`: required, other, or optional for the extensions), `python -m a4.course list --checks`
and the earlier notebooks' checks that an engine check runs again when it fails (`_earlier`). A check's code, its
reference maths and its messages stay in its notebook's module of a4/course/checks/.

A table rather than a decorator on each check function: grade and `list` read it without importing the check
modules, which import the student's code (a syntax error in an exercise must not stop grade from reporting every
check). The function is named, as its cell calls it, and imported only when a check runs it (`Check.load`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

# Notebooks from this one on are extensions: their checks are graded, but optional.
EXTENSIONS_FROM = "09"


@dataclass(frozen=True)
class Check:
    id: str
    notebook: str  # the notebook's stem, e.g. "01_config"
    # The check function its cell calls, "<module>.<function>" of a4/course/checks/, e.g. "config.check_rotary_dims"
    # (the cell may call helpers besides, never another check's function).
    function: str
    required: bool = False  # one of the assignment's checks (config parsing, weight loading, decoding, prefix cache)

    @property
    def group(self) -> str:
        """How grade counts it: "required", "other", or "optional" (an extension's)."""
        if self.notebook >= EXTENSIONS_FROM:
            return "optional"
        return "required" if self.required else "other"

    def load(self) -> Callable[..., None]:
        """The check function (importing its module imports the student's code it checks)."""
        module, name = self.function.rsplit(".", 1)
        return getattr(importlib.import_module(f".{module}", __package__), name)


CHECKS = (
    Check("config-layer-patterns", "01_config", "config.check_layer_patterns"),
    Check("config-rope", "01_config", "config.check_rotary_dims"),
    Check("config-parsing", "01_config", "config.check_checkpoint", required=True),
    Check("config-moe", "01_config", "config.check_checkpoint"),
    Check("config-presets", "01_config", "config.check_presets"),
    Check("config-errors", "01_config", "config.check_config_errors"),
    Check("weight-loading", "02_weights", "weights.check_weight_loading", required=True),
    Check("weight-skipped", "02_weights", "weights.check_weight_skipped"),
    Check("weight-errors", "02_weights", "weights.check_weight_errors"),
    Check("zero-centred-rmsnorm", "03_gated_attention", "gated_attention.check_zero_centred_norm"),
    Check("partial-rope", "03_gated_attention", "gated_attention.check_partial_rope"),
    Check("gated-attention-prefill", "03_gated_attention", "gated_attention.check_prefill"),
    Check("gated-attention-decode", "03_gated_attention", "gated_attention.check_decode"),
    Check("kv-pool-keys", "03_gated_attention", "gated_attention.check_kv_pool_keys"),
    Check("kv-pool-layers", "03_gated_attention", "gated_attention.check_kv_pool_layers"),
    Check("gdn-conv-prefill", "04_gated_deltanet", "deltanet.check_conv_prefill"),
    Check("gdn-conv-decode", "04_gated_deltanet", "deltanet.check_conv_decode"),
    Check("gdn-recurrence", "04_gated_deltanet", "deltanet.check_recurrence"),
    Check("gdn-intra-chunk", "04_gated_deltanet", "deltanet.check_intra_chunk"),
    Check("gdn-chunked", "04_gated_deltanet", "deltanet.check_chunked"),
    Check("gdn-gated-norm", "04_gated_deltanet", "deltanet.check_gated_norm"),
    Check("gdn-layer-prefill", "04_gated_deltanet", "deltanet.check_layer_prefill"),
    Check("gdn-layer-decode", "04_gated_deltanet", "deltanet.check_layer_decode"),
    Check("gdn-layer-states", "04_gated_deltanet", "deltanet.check_layer_states"),
    Check("model-logits", "04_gated_deltanet", "deltanet.check_model_logits"),
    Check("state-pool-layout", "05_state_pool", "state_pool.check_pool_layout"),
    Check("state-bytes", "05_state_pool", "state_pool.check_bytes_per_slot"),
    Check("state-save-restore", "05_state_pool", "state_pool.check_save_restore"),
    Check("state-reset", "05_state_pool", "state_pool.check_state_reset"),
    Check("decode-single", "05_state_pool", "state_pool.check_decode_single", required=True),
    Check("decode-varlen", "05_state_pool", "state_pool.check_decode_varlen", required=True),
    Check("decode-chunked", "05_state_pool", "state_pool.check_decode_chunked", required=True),
    Check("decode-slot-reuse", "05_state_pool", "state_pool.check_decode_slot_reuse", required=True),
    Check("state-poisoned", "05_state_pool", "state_pool.check_state_poisoned"),
    Check("memory-ledger", "06_memory_plan", "memory.check_ledger"),
    Check("memory-plan", "06_memory_plan", "memory.check_split"),
    Check("memory-admission", "06_memory_plan", "memory.check_admission"),
    Check("prefix-cache-refuse", "07_radix_cache", "radix.check_refuse", required=True),
    Check("prefix-cache-checkpoint", "07_radix_cache", "radix.check_checkpoint", required=True),
    Check("prefix-cache-hit-positions", "07_radix_cache", "radix.check_hit_positions"),
    Check("prefix-cache-immutable", "07_radix_cache", "radix.check_immutable"),
    Check("prefix-cache-eviction", "07_radix_cache", "radix.check_eviction"),
    Check("report-ledger", "08_report", "report.check_ledger"),
    Check("report-decode-slope", "08_report", "report.check_decode_slope"),
    Check("moe-weights", "09_moe", "moe.check_moe_weights"),
    Check("moe-layer", "09_moe", "moe.check_moe_layer"),
    Check("moe-efficiency", "09_moe", "moe.check_moe_efficiency"),
    Check("moe-decode-single", "09_moe", "moe.check_decode_single"),
    Check("moe-decode-varlen", "09_moe", "moe.check_decode_varlen"),
    Check("moe-decode-chunked", "09_moe", "moe.check_decode_chunked"),
    Check("gdn-conv-by-slot", "10_gpu", "gpu.check_conv_by_slot"),
    Check("gdn-rule-by-slot", "10_gpu", "gpu.check_rule_by_slot"),
    Check("gdn-decode-graph-safe", "10_gpu", "gpu.check_graph_safe"),
    Check("gdn-engine-static-decode", "10_gpu", "gpu.check_static_decode_engine"),
    Check("spec-conv-verify", "11_speculative", "speculative.check_conv_verify"),
    Check("spec-rule-verify", "11_speculative", "speculative.check_rule_verify"),
    Check("spec-greedy-accept", "11_speculative", "speculative.check_greedy_accept"),
    Check("spec-commit", "11_speculative", "speculative.check_commit"),
    Check("spec-poisoned-state", "11_speculative", "speculative.check_poisoned_state"),
    Check("spec-engine-greedy", "11_speculative", "speculative.check_speculative_greedy"),
    Check("tp-gdn-split", "13_tensor_parallel", "tensor_parallel.check_gdn_split"),
    Check("tp-gdn-layer", "13_tensor_parallel", "tensor_parallel.check_gdn_layer_split"),
    Check("tp-engine", "13_tensor_parallel", "tensor_parallel.check_tensor_parallel_engine"),
)
BY_ID = {check.id: check for check in CHECKS}


def checks_of(notebook: str) -> list[str]:
    """The ids of a notebook's checks (its stem), in the order of its cells."""
    return [check.id for check in CHECKS if check.notebook == notebook]


def group_of(notebook: str, check_id: str) -> str:
    """grade's group of a check cell of `notebook` (its stem or file name); a check the table does not know (in a
    test's notebook) is not required."""
    return BY_ID.get(check_id, Check(check_id, notebook, function="")).group
