"""The one table of the course's checks: every check cell's id, its notebook, and whether the assignment requires it.

Everything else that names checks follows this table: a notebook's check cells (their tag `check:<id>` and their
`with checking("<id>"):`, in this order; verify-notebooks lints both against it), grade's groups (`group_of`:
required, other, or optional for the extensions) and `python -m a4.course list --checks`. A check's code, its
reference maths and its messages stay in its notebook's module of a4/course/checks/.
"""

from __future__ import annotations

from dataclasses import dataclass

# Notebooks from this one on are extensions: their checks are graded, but optional.
EXTENSIONS_FROM = "09"


@dataclass(frozen=True)
class Check:
    id: str
    notebook: str  # the notebook's stem, e.g. "01_config"
    required: bool = False  # one of the assignment's checks (config parsing, weight loading, decoding, prefix cache)

    @property
    def group(self) -> str:
        """How grade counts it: "required", "other", or "optional" (an extension's)."""
        if self.notebook >= EXTENSIONS_FROM:
            return "optional"
        return "required" if self.required else "other"


CHECKS = (
    Check("config-layer-patterns", "01_config"),
    Check("config-rope", "01_config"),
    Check("config-parsing", "01_config", required=True),
    Check("config-moe", "01_config"),
    Check("config-presets", "01_config"),
    Check("config-errors", "01_config"),
    Check("weight-loading", "02_weights", required=True),
    Check("weight-skipped", "02_weights"),
    Check("weight-errors", "02_weights"),
    Check("zero-centred-rmsnorm", "03_gated_attention"),
    Check("partial-rope", "03_gated_attention"),
    Check("gated-attention-prefill", "03_gated_attention"),
    Check("gated-attention-decode", "03_gated_attention"),
    Check("kv-pool-keys", "03_gated_attention"),
    Check("kv-pool-layers", "03_gated_attention"),
    Check("gdn-conv-prefill", "04_gated_deltanet"),
    Check("gdn-conv-decode", "04_gated_deltanet"),
    Check("gdn-recurrence", "04_gated_deltanet"),
    Check("gdn-intra-chunk", "04_gated_deltanet"),
    Check("gdn-chunked", "04_gated_deltanet"),
    Check("gdn-gated-norm", "04_gated_deltanet"),
    Check("gdn-layer-prefill", "04_gated_deltanet"),
    Check("gdn-layer-decode", "04_gated_deltanet"),
    Check("gdn-layer-states", "04_gated_deltanet"),
    Check("model-logits", "04_gated_deltanet"),
    Check("state-pool-layout", "05_state_pool"),
    Check("state-bytes", "05_state_pool"),
    Check("state-save-restore", "05_state_pool"),
    Check("state-reset", "05_state_pool"),
    Check("decode-single", "05_state_pool", required=True),
    Check("decode-varlen", "05_state_pool", required=True),
    Check("decode-chunked", "05_state_pool", required=True),
    Check("decode-slot-reuse", "05_state_pool", required=True),
    Check("state-poisoned", "05_state_pool"),
    Check("memory-ledger", "06_memory_plan"),
    Check("memory-plan", "06_memory_plan"),
    Check("memory-admission", "06_memory_plan"),
    Check("prefix-cache-refuse", "07_radix_cache", required=True),
    Check("prefix-cache-checkpoint", "07_radix_cache", required=True),
    Check("prefix-cache-hit-positions", "07_radix_cache"),
    Check("prefix-cache-immutable", "07_radix_cache"),
    Check("prefix-cache-eviction", "07_radix_cache"),
    Check("report-ledger", "08_report"),
    Check("report-decode-slope", "08_report"),
    Check("moe-weights", "09_moe"),
    Check("moe-layer", "09_moe"),
    Check("moe-efficiency", "09_moe"),
    Check("moe-decode-single", "09_moe"),
    Check("moe-decode-varlen", "09_moe"),
    Check("moe-decode-chunked", "09_moe"),
    Check("gdn-conv-by-slot", "10_gpu"),
    Check("gdn-rule-by-slot", "10_gpu"),
    Check("gdn-decode-graph-safe", "10_gpu"),
    Check("gdn-engine-static-decode", "10_gpu"),
    Check("spec-conv-verify", "11_speculative"),
    Check("spec-rule-verify", "11_speculative"),
    Check("spec-greedy-accept", "11_speculative"),
    Check("spec-commit", "11_speculative"),
    Check("spec-poisoned-state", "11_speculative"),
    Check("spec-engine-greedy", "11_speculative"),
    Check("tp-gdn-split", "13_tensor_parallel"),
    Check("tp-gdn-layer", "13_tensor_parallel"),
    Check("tp-engine", "13_tensor_parallel"),
)
BY_ID = {check.id: check for check in CHECKS}


def checks_of(notebook: str) -> list[str]:
    """The ids of a notebook's checks (its stem), in the order of its cells."""
    return [check.id for check in CHECKS if check.notebook == notebook]


def group_of(notebook: str, check_id: str) -> str:
    """grade's group of a check cell of `notebook` (its stem or file name); a check the table does not know (in a
    test's notebook) is not required."""
    return BY_ID.get(check_id, Check(check_id, notebook)).group
