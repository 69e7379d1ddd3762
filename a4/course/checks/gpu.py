"""Checks of notebook 10: the GDN decode step by slot (`a4/layers/gdn_decode.py`).

Ground truths:
- values: transformers' own torch code for one decode token, `causal_conv1d_update` and
  `torch_recurrent_gated_delta_rule` (fed what Qwen3_5GatedDeltaNet.forward feeds it), run on copies of the rows the
  slots name;
- the pool: rows not named by a slot keep their values bit for bit; the rows named are updated in the pool tensor
  the function was given (writing into a copy changes nothing the next step reads). A batch padded with a dummy
  slot, several rows sharing it, must leave the real rows right;
- capturable: three tests a CPU can run of what a CUDA graph needs. The function runs on the `meta` device, where a
  tensor has a shape and no values, so anything that reads values into Python fails there (a host sync on a GPU);
  its number of tensor operations is the same for 2 requests as for 5 (no Python loop over the requests); and
  `torch.compile(backend="eager", fullgraph=True)` traces it as one graph. Indexing by a tensor of slots, read
  (`pool[slots]`) or written (`pool[slots] = rows`), is graph-safe: the index kernel reads the slots on the device.

The shapes are not the notebook's: value heads 3x key heads or as many, dk != dv, conv kernels 2, 3 and 4.
"""

from __future__ import annotations

import linecache
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from a4.course.checks import conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks._harness import DTYPES, compare, compare_dtype, randn, shape_problems, tolerance
from a4.course.checks.common import MAX_NEW_TOKENS, reference_tokens, shared_prompts, token_problems
from a4.course.checks.deltanet import CONV_KERNELS, SHAPES

NUM_SLOTS = 7
# Real requests in slots out of order; then a padded batch: dummy slot 0 on two rows, as a CUDA-graph bucket pads.
SLOT_CASES = {"3 requests": [4, 1, 6], "2 requests padded to 4 with dummy slot 0": [5, 0, 2, 0]}
DUMMY_SLOT = 0
CONV_CHANNELS = 10
# Batch sizes whose operation counts must agree (a Python loop over the requests makes them differ). Not 1: there
# PyTorch runs some operations its own way (`pool[slots] = rows` adds a `view` at batch 1, a reshape of a slice that
# happens to be contiguous copies nothing), so a right function may count one operation more or less.
LOOP_BATCHES = (2, 5)


# ------------------------------------------------------------------------------------------------------- the inputs


def conv_inputs(batch: int, kernel: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Arguments of conv_update_by_slot_ but `slots`: x [B, D], weight [D, 1, K], a random pool [NUM_SLOTS, D, K-1]."""
    return {
        "x": randn(batch, CONV_CHANNELS, seed=seed, dtype=dtype),
        "weight": randn(CONV_CHANNELS, 1, kernel, seed=seed + 1, dtype=dtype),
        "conv_state": randn(NUM_SLOTS, CONV_CHANNELS, kernel - 1, seed=seed + 2, dtype=dtype),
    }


def rule_inputs(batch: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Arguments of gated_delta_rule_update_by_slot_ but `slots`, as the layer makes them, and a random state pool."""
    key_heads, value_heads, dk, dv = shape[:4]
    return {
        "q": randn(batch, key_heads, dk, seed=seed, dtype=dtype),
        "k": randn(batch, key_heads, dk, seed=seed + 1, dtype=dtype),
        "v": randn(batch, value_heads, dv, seed=seed + 2, dtype=dtype),
        "a": randn(batch, value_heads, seed=seed + 3, dtype=dtype),
        "b": randn(batch, value_heads, seed=seed + 4, dtype=dtype),
        # As transformers initialises them: A in [1, 16] (strong and weak decays), dt_bias around 1.
        "A_log": (1 + 15 * torch.rand(value_heads, generator=torch.Generator().manual_seed(seed + 5))).log().to(dtype),
        "dt_bias": (1 + 0.5 * randn(value_heads, seed=seed + 6)).to(dtype),
        "state": 0.5 * randn(NUM_SLOTS, value_heads, dk, dv, seed=seed + 7),
    }


def slot_tensor(slots: list[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------- transformers' code


def transformers_conv(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' causal_conv1d_update on copies of the rows `states` [B, D, K-1]: (y [B, D], new states).

    transformers keeps K inputs where a4 keeps K-1; the oldest is never read by a one-token step (zeros here)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    hf_state = torch.cat([torch.zeros_like(states[:, :, :1]), states], dim=2)
    y = causal_conv1d_update(x[:, :, None], hf_state, weight.squeeze(1), activation="silu")[:, :, 0]
    return y, hf_state[:, :, 1:]


def transformers_rule(inputs: dict[str, torch.Tensor], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' torch_recurrent_gated_delta_rule for one token, from copies of the rows `states`, fed as
    Qwen3_5GatedDeltaNet.forward feeds it (beta and g computed as it does, l2 norm in the kernel):
    (o [B, Hv, dv] float32, new states [B, Hv, dk, dv])."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    a, b, A_log, dt_bias = (inputs[name] for name in ("a", "b", "A_log", "dt_bias"))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    # q and k repeated to the value heads, as the layer of transformers 5.17 feeds them (later releases repeat them
    # inside the function, only where the head counts differ). They go in as float32 (an exact conversion:
    # transformers converts them itself), so o comes out in float32.
    group = inputs["v"].shape[1] // inputs["k"].shape[1]
    q, k = (inputs[name].repeat_interleave(group, dim=1) for name in ("q", "k"))
    o, final = torch_recurrent_gated_delta_rule(
        *(x[:, None].float() for x in (q, k, inputs["v"])),
        g=g[:, None],
        beta=b.sigmoid()[:, None],
        initial_state=states.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[:, 0], final


def rule_tolerance(dk: int) -> float:
    """float32 (see `_harness.tolerance`): the l2 norms, S^T k and S^T q are each a dk-long sum."""
    return tolerance(torch.float32, 3 * dk)


# ------------------------------------------------------------------------------------------------------- the pool


class PoolWrites(TorchDispatchMode):
    """Records, while it is on, where a function put values that did not reach the pool tensors it was given: every
    tensor an operation writes in place (`copy_`, `index_copy_`, `x[i] = ...`) that is not a pool's memory, and every
    result of a pool's shape that an out-of-place operation returns (`index_copy`, `clone`). Each comes with the line
    of the function's file that ran it, which is what a student needs to find the copy."""

    def __init__(self, fn: Callable, pools: list[torch.Tensor]) -> None:
        super().__init__()
        self.filename = fn.__code__.co_filename
        self.pools = pools
        self.writes: list[tuple[torch.Tensor, str]] = []  # (the tensor written, "line N: `source`" or "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        arguments = func._schema.arguments
        values = [*args, *(kwargs.get(a.name) for a in arguments[len(args) :])]
        written = [v for a, v in zip(arguments, values) if a.alias_info is not None and a.alias_info.is_write]
        if not written:  # out-of-place: only a result of a pool's shape can be a copy of a whole pool
            results = result if isinstance(result, (tuple, list)) else [result]
            shapes = [pool.shape for pool in self.pools]
            written = [r for r in results if isinstance(r, torch.Tensor) and r.shape in shapes]
        for tensor in written:
            if isinstance(tensor, torch.Tensor) and not any(_same_memory(tensor, p) for p in self.pools):
                self.writes.append((tensor, self._caller_line()))
        return result

    def _caller_line(self) -> str:
        frames = [frame for frame in traceback.extract_stack() if frame.filename == self.filename]
        return f"line {frames[-1].lineno}: `{frames[-1].line}`" if frames else ""

    def copy_of(self, pool: torch.Tensor, before: torch.Tensor) -> str | None:
        """Where the function wrote new values into a copy of `pool` or of some of its rows ("line N: `source`", or
        "" when that line is not in its file); None if it wrote into no such copy. `before`: the pool's values."""
        for tensor, line in self.writes:
            rows = tensor.dim() == pool.dim() and tensor.shape[1:] == pool.shape[1:]
            if rows and not (tensor.shape == pool.shape and torch.equal(tensor, before)):
                return line
        return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def unchanged_pool_problem(label: str, pool: torch.Tensor, before: torch.Tensor, writes: PoolWrites) -> str:
    """Why a pool the function had to update is unchanged: its new rows went into a copy (named), or nowhere."""
    in_place = ("write into the pool tensor you are given, in place: `pool.index_copy_(0, slots, rows)` or "
                "`pool[slots] = rows`")
    where = writes.copy_of(pool, before)
    if where is None:
        return f"{label}: the pool is unchanged: nothing was written into it (nor into a copy of it); {in_place}"
    at = f" ({where})" if where else ""
    return (f"{label}: the pool is unchanged: the new rows were written into a copy of it{at}, which the caller never "
            "sees. `pool[slots]` read with a tensor of slots is a copy (so is `.clone()`, and so is what an operation "
            f"without the trailing `_` returns, `pool.index_copy(...)`); {in_place}")


def pool_problems(label: str, pool: torch.Tensor, before: torch.Tensor, slots: list[int], expected: torch.Tensor,
                  allowed: float | None, writes: PoolWrites) -> list[str]:
    """The pool after the call (whose writes `writes` recorded): each real slot's row as expected (equal when allowed
    is None), the rows no slot names untouched, and the pool tensor itself written (not a copy of it)."""
    if torch.equal(pool, before):
        return [unchanged_pool_problem(label, pool, before, writes)]
    problems = []
    for i in _real_rows(slots):
        row, want = pool[slots[i]], expected[i]
        where = f"{label}: the new state in slot {slots[i]} (request {i})"
        if allowed is None:  # a copy of inputs: equal, bit for bit
            if not torch.equal(row, want):
                problems.append(f"{where} must be the last K-1 inputs (its old state + x)")
        else:
            problems += compare(where, row, want, allowed)
    changed = [slot for slot in range(pool.shape[0]) if slot not in slots and not torch.equal(pool[slot], before[slot])]
    if changed:
        problems.append(f"{label}: slot(s) {changed} are not in `slots` {slots} but were changed: write only the "
                        "batch's rows")
    return problems


def _real_rows(slots: list[int]) -> list[int]:
    """The rows of the batch that are requests, not padding (padding rows share the dummy slot: garbage)."""
    padded = slots.count(DUMMY_SLOT) > 1
    return [i for i, slot in enumerate(slots) if not (padded and slot == DUMMY_SLOT)]


def _real(tensor: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return tensor[_real_rows(slots)]


# ------------------------------------------------------------------------------------------------------ the checks


def update_problems(label: str, slots: list[int], pool: torch.Tensor, fn: Callable, kwargs: dict[str, torch.Tensor],
                    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                    allowed: float, state_allowed: float | None, elementwise: bool) -> list[str]:
    """Run fn(**kwargs) (which updates `pool` by `slots`) and compare its output and the pool with what
    reference(copies of the slots' rows) returns: (output, new rows). The padding rows' outputs are not compared."""
    before = pool.clone()
    expected, expected_states = reference(before[slots])
    with PoolWrites(fn, [pool]) as writes:
        output = fn(**kwargs)
    if wrong := shape_problems(f"{label}: output", output, expected.shape):
        return wrong
    problems = compare_dtype(f"{label}: output", _real(output, slots), _real(expected, slots), allowed, elementwise)
    return problems + pool_problems(label, pool, before, slots, expected_states, state_allowed, writes)


def check_conv_by_slot(conv_update: Callable) -> None:
    """conv_update_by_slot_ against transformers' causal_conv1d_update, for conv kernels 2, 3 and 4 in float32 and
    bfloat16, three requests in slots out of order and a batch padded with a shared dummy slot."""
    problems = []
    for kernel in CONV_KERNELS:
        for dtype_name, dtype in DTYPES.items():
            for case, slots in SLOT_CASES.items():
                i = conv_inputs(len(slots), kernel, dtype, seed=kernel)
                problems += update_problems(
                    f"kernel {kernel}, {dtype_name}, {case}", slots, i["conv_state"],
                    conv_update, {**i, "slots": slot_tensor(slots)},
                    lambda rows: transformers_conv(i["x"], i["weight"], rows),
                    # A sum of `kernel` products per value, one rounding; the new states are copies of inputs.
                    allowed=tolerance(dtype, kernel), state_allowed=None, elementwise=True,
                )  # fmt: skip
    conclude(problems, "conv_update_by_slot_ matches transformers' causal_conv1d_update; the slots' conv states are "
                       "updated in the pool, every other slot untouched, padded rows harmless")


def check_rule_by_slot(rule_update: Callable) -> None:
    """gated_delta_rule_update_by_slot_ against transformers' torch_recurrent_gated_delta_rule, for three head
    layouts with inputs in float32 and bfloat16, three requests in slots out of order and a padded batch."""
    problems = []
    for shape_name, shape in SHAPES.items():
        dk = shape[2]
        for dtype_name, dtype in DTYPES.items():
            for case, slots in SLOT_CASES.items():
                i = rule_inputs(len(slots), shape, dtype, seed=dk)
                problems += update_problems(
                    f"{shape_name}, {dtype_name}, {case}", slots, i["state"],
                    rule_update, {**i, "slots": slot_tensor(slots)},
                    lambda rows: transformers_rule(i, rows),
                    allowed=rule_tolerance(dk), state_allowed=rule_tolerance(dk), elementwise=False,
                )  # fmt: skip
    conclude(problems, "gated_delta_rule_update_by_slot_ matches transformers' torch_recurrent_gated_delta_rule; the "
                       "slots' states are updated in the pool, every other slot untouched, padded rows harmless")


def check_graph_safe(conv_update: Callable, rule_update: Callable) -> None:
    """Both functions as a CUDA graph needs them: no host sync, no Python loop over the requests, one graph."""
    shape = next(iter(SHAPES.values()))

    def conv_call(batch: int) -> tuple[Callable, dict[str, torch.Tensor]]:
        return conv_update, {**conv_inputs(batch, 4, torch.bfloat16), "slots": slot_tensor(list(range(1, batch + 1)))}

    def rule_call(batch: int) -> tuple[Callable, dict[str, torch.Tensor]]:
        return rule_update, {**rule_inputs(batch, shape, torch.bfloat16), "slots": slot_tensor(list(range(batch)))}

    problems = []
    for make_call in (conv_call, rule_call):
        fn, _ = make_call(1)
        name = getattr(fn, "__name__", repr(fn))
        # Once as it is first: an unwritten exercise, or an error of its own, shows as itself, not as a capture problem.
        fn(**make_call(2)[1])
        problems += [f"{name}: {p}" for p in capture_problems(make_call)]
    conclude(problems, "both functions are capturable: no host sync, the same operations for any batch size, one "
                       "graph under torch.compile(fullgraph=True)")


# --------------------------------------------------------------------------------------------- capturable or not


def capture_problems(make_call: Callable[[int], tuple[Callable, dict[str, torch.Tensor]]]) -> list[str]:
    """What stops fn from being captured in a CUDA graph; make_call(batch) -> (fn, its keyword arguments)."""
    fn, kwargs = make_call(LOOP_BATCHES[-1])
    if sync := host_sync(fn, kwargs):
        return [sync]
    loop = batch_loop_problems(fn, lambda batch: on_meta(make_call(batch)[1]),
                               "A graph replays a fixed list of kernels for one batch size; work on all rows at once "
                               "(index_select or pool[slots], batched products, index_copy_ or pool[slots] = rows)")
    return loop or graph_problems(make_call)


def batch_loop_problems(fn: Callable, make_kwargs: Callable[[int], dict[str, Any]], advice: str) -> list[str]:
    """A problem when fn(**make_kwargs(batch)) runs a different number of tensor operations for each batch size of
    LOOP_BATCHES: the operations of a Python loop over the requests are repeated per request. `advice`: what to
    do instead."""
    counts = {batch: len(aten_ops(fn, make_kwargs(batch))) for batch in LOOP_BATCHES}
    if len(set(counts.values())) == 1:
        return []
    described = ", ".join(f"{n} for {batch} requests" for batch, n in counts.items())
    return [f"its number of tensor operations differs with the batch ({described}): a Python loop over the "
            f"requests. {advice}"]


def host_sync(fn: Callable, kwargs: dict[str, torch.Tensor]) -> str | None:
    """None if fn runs on `meta` tensors (shapes, no values); else why not, at which line of the student's code."""
    if (where := reads_values(fn, kwargs)) is None:
        return None
    return (f"it reads tensor values into Python ({where}). On a GPU that is a host sync: Python waits for the GPU "
            "(`.item()`, `.tolist()`, `int(t)`, `if t:`, a loop over `slots`, a boolean mask), and a CUDA graph "
            "replays without Python, so a decision taken from those values would be frozen at capture. Keep "
            "everything in tensor operations")


def reads_values(fn: Callable, kwargs: dict[str, torch.Tensor]) -> str | None:
    """None if fn(**kwargs) runs on `meta` tensors, which have shapes and no values; else where it needed a value:
    "line N: `source`: the error" (the line of fn's file)."""
    try:
        fn(**on_meta(kwargs))
    except NotImplementedError as e:
        if str(e).startswith("Exercise "):
            raise
        return f"{_user_line(fn, e)}: {str(e).splitlines()[0]}"
    except RuntimeError as e:
        return f"{_user_line(fn, e)}: {str(e).splitlines()[0]}"
    return None


def _user_line(fn: Callable, error: BaseException) -> str:
    """'line N: `source`' of the deepest frame in fn's file (where the student's code is) of error's traceback, or of
    the code torch.compile was tracing (`real_stack`)."""
    filename = fn.__code__.co_filename
    stack = [*traceback.extract_tb(error.__traceback__), *(getattr(error, "real_stack", None) or [])]
    frames = [frame for frame in stack if frame.filename == filename]
    if not frames:
        return f"in {fn.__name__}"
    line = linecache.getline(filename, frames[-1].lineno).strip()
    return f"line {frames[-1].lineno}: `{line}`"


class _OpRecorder(TorchDispatchMode):
    """Records every ATen operation run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def on_meta(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The same arguments with every tensor on the `meta` device: shapes and dtypes, no values."""
    return {name: value.to("meta") if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}


def aten_ops(fn: Callable, kwargs: dict[str, Any]) -> list[str]:
    """The ATen operations fn(**kwargs) runs, in order: on a GPU, about one kernel launch each. On `meta` tensors
    (`on_meta`) the list comes without the arithmetic."""
    with _OpRecorder() as recorder:
        fn(**kwargs)
    return recorder.ops


def graph_problems(make_call: Callable[[int], tuple[Callable, dict[str, torch.Tensor]]]) -> list[str]:
    """torch.compile(backend="eager", fullgraph=True) traces fn in one graph (the CPU's stand-in for a capture)."""
    fn, kwargs = make_call(LOOP_BATCHES[-1])
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)(**kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to trace is what is reported
        return [f"torch.compile(fullgraph=True) cannot trace it as one graph ({_user_line(fn, e)}): "
                f"{str(e).strip().splitlines()[0]}"]
    finally:
        torch._dynamo.reset()
    return []


@after_notebooks(*ENGINE, "05", "10")
def check_static_decode_engine(checkpoint: str | Path) -> None:
    """The engine's decode on static buffers (`cuda_graphs=True`: on a CPU the GPU's decode path, run eagerly), whose
    GDN layers decode with your two functions: the shared prompts (1 to 300 tokens) through 3 slots, chunked prefill,
    decode batches padded to buckets of 2 and 4 on the padding slot, slots reused; every token equal to
    transformers' greedy `generate`."""
    from a4.core import SamplingParams
    from a4.llm import LLM

    prompts = shared_prompts(checkpoint)
    llm = LLM(checkpoint, cuda_graphs=True, max_running_requests=3, max_prefill_tokens=64,
              hybrid_prefix_policy="refuse")  # fmt: skip
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    problems = token_problems("static-buffer decode", outputs, prompts, reference_tokens(checkpoint))
    conclude(
        problems,
        f"{len(prompts)} requests through 3 slots, decoded on static buffers with your by-slot functions: "
        f"{sum(len(o.token_ids) for o in outputs)} tokens equal to transformers'",
    )
