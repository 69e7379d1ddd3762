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
from typing import ParamSpec, TypeVar

from a4.course.checks import CheckFailed
from a4.course.checks.registry import BY_ID

P = ParamSpec("P")
R = TypeVar("R")


def _student(module: str, name: str) -> object:
    """The student's `name` from `module`, imported when the check runs (an import error is that check's failure)."""
    return getattr(importlib.import_module(module), name)


def _tiny(name: str = "qwen3_5") -> str:
    from a4.checkpoints import tiny_checkpoint

    return str(tiny_checkpoint(name))


# What the engine runs of the earlier notebooks: the config, the weights and both kinds of layer.
ENGINE = ("01", "02", "03", "04")
CONFIG, ATTENTION, DELTANET = "a4.models.qwen3_5_config", "a4.layers.gated_attention", "a4.layers.deltanet"
POOL, BY_SLOT = "a4.kvcache.state_pool", "a4.layers.gdn_decode"
# Each notebook's checks of its own code, without the whole-model ones (those are what is being explained): how each
# calls its check function (the table of checks gives the function and the notebook) on the student's code.
EARLIER_CHECKS: dict[str, Callable[[Callable[..., None]], None]] = {
    "config-layer-patterns": lambda check: check(_student(CONFIG, "qwen3_5_layer_types")),
    "config-rope": lambda check: check(_student(CONFIG, "qwen3_5_rotary_dim")),
    "config-parsing": lambda check: check(_tiny(), label="tiny Qwen3.5"),
    "weight-loading": lambda check: check(_tiny()),
    "zero-centred-rmsnorm": lambda check: check(_student(ATTENTION, "ZeroCenteredRMSNorm")),
    "partial-rope": lambda check: check(_student(ATTENTION, "apply_partial_rope")),
    "gated-attention-prefill": lambda check: check(_student(ATTENTION, "GatedAttention")),
    "gated-attention-decode": lambda check: check(_student(ATTENTION, "GatedAttention")),
    "kv-pool-layers": lambda check: check(_student(ATTENTION, "GatedAttention")),
    "gdn-conv-prefill": lambda check: check(_student(DELTANET, "causal_conv1d_prefill")),
    "gdn-conv-decode": lambda check: check(_student(DELTANET, "causal_conv1d_decode")),
    "gdn-recurrence": lambda check: check(_student(DELTANET, "recurrent_gated_delta_rule")),
    "gdn-chunked": lambda check: check(_student(DELTANET, "chunk_gated_delta_rule")),
    "gdn-gated-norm": lambda check: check(_student(DELTANET, "GatedRMSNorm")),
    "gdn-layer-prefill": lambda check: check(_student(DELTANET, "GatedDeltaNet")),
    "gdn-layer-decode": lambda check: check(_student(DELTANET, "GatedDeltaNet")),
    "state-pool-layout": lambda check: check(_student(POOL, "StatePool"), _tiny()),
    "state-save-restore": lambda check: check(_student(POOL, "StatePool"), _tiny()),
    # The verify pass of speculative decoding (notebook 11) runs notebook 10's decode step by slot on a CPU too. Its
    # values only: the engine's tokens do not depend on the graph-safe check (and its torch.compile is slow).
    "gdn-conv-by-slot": lambda check: check(_student(BY_SLOT, "conv_update_by_slot_")),
    "gdn-rule-by-slot": lambda check: check(_student(BY_SLOT, "gated_delta_rule_update_by_slot_")),
}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def earlier_failures(notebooks: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """(notebook, a line per failing check) of the first of `notebooks` whose checks fail, or None."""
    for notebook in notebooks:
        failures = []
        for check_id, run in EARLIER_CHECKS.items():
            check = BY_ID[check_id]
            if not check.notebook.startswith(f"{notebook}_"):
                continue
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # their "PASSED" lines are not this check's
                    run(check.load())
            except Exception as e:  # noqa: BLE001 - whatever it raised, that check fails
                failures.append(f"{check_id}: {_first_line(e)}")
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
