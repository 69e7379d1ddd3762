"""The earlier notebooks' layer-level checks, run again when an engine-level check fails: the cause may be there.

The engine checks of notebooks 05, 06, 07, 09 and 11 run the whole model, so a wrong norm from notebook 03 shows
up there as a wrong token, far from its cause. `after_notebooks` wraps such a check: when it fails, the cheap checks of
the notebooks it builds on run again, and if one of them fails the failure's first line says which notebook to fix
first (an unwritten exercise already says so through its NotImplementedError). They run on every failure, not
once per process: a student who fixes notebook 03 and runs the engine check again must not read a stale verdict.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from a4.course.checks import CheckFailed

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class EarlierCheck:
    notebook: str  # "03"
    check_id: str  # the id of its check cell
    run: Callable[[], None]  # raises when the check fails


def _student(module: str, name: str) -> object:
    """The student's `name` from `module`, imported when the check runs (an import error is that check's failure)."""
    return getattr(importlib.import_module(module), name)


def _checks(topic: str):
    return importlib.import_module(f"a4.course.checks.{topic}")


def _tiny(name: str = "qwen3_5") -> str:
    from a4.checkpoints import tiny_checkpoint

    return str(tiny_checkpoint(name))


# What the engine runs of the earlier notebooks: the config, the weights and both kinds of layer.
ENGINE = ("01", "02", "03", "04")
ATTENTION, DELTANET, POOL = "a4.layers.gated_attention", "a4.layers.deltanet", "a4.kvcache.state_pool"
BY_SLOT = "a4.layers.gdn_decode"
# Each notebook's checks of its own code, without the whole-model ones (those are what is being explained).
EARLIER_CHECKS = (
    EarlierCheck("01", "config-layer-patterns", lambda: _checks("config").check_layer_patterns(
        _student("a4.models.qwen3_5_config", "qwen3_5_layer_types"))),
    EarlierCheck("01", "config-rope", lambda: _checks("config").check_rotary_dims(
        _student("a4.models.qwen3_5_config", "qwen3_5_rotary_dim"))),
    EarlierCheck("01", "config-parsing", lambda: _checks("config").check_checkpoint(_tiny(), label="tiny Qwen3.5")),
    EarlierCheck("02", "weight-loading", lambda: _checks("weights").check_weight_loading(_tiny())),
    EarlierCheck("03", "zero-centred-rmsnorm", lambda: _checks("gated_attention").check_zero_centred_norm(
        _student(ATTENTION, "ZeroCenteredRMSNorm"))),
    EarlierCheck("03", "partial-rope", lambda: _checks("gated_attention").check_partial_rope(
        _student(ATTENTION, "apply_partial_rope"))),
    EarlierCheck("03", "gated-attention-prefill", lambda: _checks("gated_attention").check_prefill(
        _student(ATTENTION, "GatedAttention"))),
    EarlierCheck("03", "gated-attention-decode", lambda: _checks("gated_attention").check_decode(
        _student(ATTENTION, "GatedAttention"))),
    EarlierCheck("03", "kv-pool-layers", lambda: _checks("gated_attention").check_kv_pool_layers(
        _student(ATTENTION, "GatedAttention"))),
    EarlierCheck("04", "gdn-conv-prefill", lambda: _checks("deltanet").check_conv_prefill(
        _student(DELTANET, "causal_conv1d_prefill"))),
    EarlierCheck("04", "gdn-conv-decode", lambda: _checks("deltanet").check_conv_decode(
        _student(DELTANET, "causal_conv1d_decode"))),
    EarlierCheck("04", "gdn-recurrence", lambda: _checks("deltanet").check_recurrence(
        _student(DELTANET, "recurrent_gated_delta_rule"))),
    EarlierCheck("04", "gdn-chunked", lambda: _checks("deltanet").check_chunked(
        _student(DELTANET, "chunk_gated_delta_rule"))),
    EarlierCheck("04", "gdn-gated-norm", lambda: _checks("deltanet").check_gated_norm(
        _student(DELTANET, "GatedRMSNorm"))),
    EarlierCheck("04", "gdn-layer-prefill", lambda: _checks("deltanet").check_layer_prefill(
        _student(DELTANET, "GatedDeltaNet"))),
    EarlierCheck("04", "gdn-layer-decode", lambda: _checks("deltanet").check_layer_decode(
        _student(DELTANET, "GatedDeltaNet"))),
    EarlierCheck("05", "state-pool-layout", lambda: _checks("state_pool").check_pool_layout(
        _student(POOL, "StatePool"), _tiny())),
    EarlierCheck("05", "state-save-restore", lambda: _checks("state_pool").check_save_restore(
        _student(POOL, "StatePool"), _tiny())),
    # The verify pass of speculative decoding (notebook 11) runs notebook 10's decode step by slot on a CPU too. Its
    # values only: the engine's tokens do not depend on the graph-safe check (and its torch.compile is slow).
    EarlierCheck("10", "gdn-conv-by-slot", lambda: _checks("gpu").check_conv_by_slot(
        _student(BY_SLOT, "conv_update_by_slot_"))),
    EarlierCheck("10", "gdn-rule-by-slot", lambda: _checks("gpu").check_rule_by_slot(
        _student(BY_SLOT, "gated_delta_rule_update_by_slot_"))),
)  # fmt: skip


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def earlier_failures(notebooks: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(notebook, a line per failing check) of the first of `notebooks` whose checks fail, or None."""
    for notebook in notebooks:
        failures = []
        for check in (c for c in EARLIER_CHECKS if c.notebook == notebook):
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # their "PASSED" lines are not this check's
                    check.run()
            except Exception as e:  # noqa: BLE001 - whatever it raised, that check fails
                failures.append(f"{check.check_id}: {_first_line(e)}")
        if failures:
            return notebook, failures
    return None


def after_notebooks(*notebooks: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Make a check that runs the code of `notebooks` name the first of them whose own checks fail, when it fails."""

    def wrap(check: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(check)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return check(*args, **kwargs)
            except NotImplementedError:
                raise  # its message names the exercise to write
            except Exception as e:
                if (earlier := earlier_failures(notebooks)) is None:
                    raise
                notebook, failures = earlier
                ids = ", ".join(line.split(":")[0] for line in failures)
                raise CheckFailed(
                    f"fix notebook {notebook}'s failing checks first ({ids}): this check runs that code\n"
                    + "\n".join(f"  - notebook {notebook}, {line}" for line in failures)
                    + f"\nthis check's own failure: {type(e).__name__}: {e}"
                ) from e

        return run

    return wrap
