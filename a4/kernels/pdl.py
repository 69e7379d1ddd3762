"""Programmatic dependent launch (PDL) for a4's Triton kernels: the next kernel of a step starts while this one ends.

Why: a decode step at a small batch is hundreds of short kernels (a Qwen3.5-0.8B step at batch 1: ~280, most of them a
few microseconds), and between two of them the GPU drains one grid before it launches and schedules the next, even
inside a CUDA graph. On Hopper and later a kernel launched with PDL may be scheduled before the kernel before it has
finished: it waits at `griddepcontrol.wait` until that kernel has completed and its writes are visible, so the launch
and the scheduling of its programs overlap the end of its predecessor (CUDA's "programmatic dependent launch"; SGLang
and TensorRT-LLM launch their decode kernels so). Each of a4's kernels waits before it reads anything the kernel before
may have written, and before it writes anything, so it computes what it computes without PDL; then it lets the kernel
after it launch. So when a kernel starts, only the kernel just before it can still be running: that one let it launch
only after its own wait, when every kernel before it had completed (a kernel launched without PDL, torch's, lets the
next start only when it has completed). What the kernel just before cannot write may therefore be read before the wait,
overlapping that kernel's end: the GEMV reads its first tile of weights so (no kernel writes a weight), the GDN rule its
slots' state tiles (the kernel before it writes none of them). This holds only while every kernel launched with PDL lets
the next launch after its wait, as a4's do; a kernel of another library that let it launch earlier would break it.

Which launches: measured on one H100 (`python -m a4 bench gpu`, the 0.8B's shapes, one run each on one machine,
solutions/REPORT.md §5), PDL on every launch took decode at batch 1 from 1.156 to 1.012 ms (0.88x) but prefill 512 /
2,048 from 4.95 / 11.33 to 5.34 / 11.81 ms: a kernel of many waves (a prefill norm's 2,048 rows) still needs the SMs
that the next kernel's programs, launched early, sit waiting on. On one-wave grids alone (at most a program per SM)
batch 1 kept only 0.99x: its gain is the GEMV's, whose grids are several waves of short programs. So PDL is on for
a grid of one wave and for the GEMV (`decode_only=True`: at most four rows, by construction a decode kernel).

A kernel takes `PDL: tl.constexpr` and calls `wait_for_previous_kernel(PDL)` first (or after such reads); its launch
passes `**pdl_launch(device, programs)`. Off (a plain launch, no wait compiled in) before Hopper, on the CPU (Triton's
interpreter) and where `A4_PDL=0` (to measure what it saves, as above).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL: wait for the kernel before to complete (its writes visible), then let the kernel after launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _one_wave(device: torch.device) -> int:
    """How many programs make one wave on `device`, as a rule of thumb one per SM; 0 where PDL is off."""
    if device.type != "cuda" or os.environ.get("A4_PDL", "1") == "0":
        return 0
    if torch.cuda.get_device_capability(device)[0] < 9:
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_launch(device: torch.device, programs: int, decode_only: bool = False) -> dict:
    """The launch arguments of a kernel of `programs` programs on `device`: its PDL constexpr and Triton's launch
    option. On for a grid of one wave, or any grid of a `decode_only` kernel, where PDL is on at all."""
    one_wave = _one_wave(device)
    if one_wave == 0 or (programs > one_wave and not decode_only):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}
