"""The floors of two committed reports recomputed with the current `ModelBytes`: a one-off of REPORT.md §4 and §5.

Not a part of `python -m a4 bench`: run from the repository root on any machine (the CPU is enough),

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/refloor.py

Issue 19's ninth round made the decode floor count each request's GDN state twice, read and written back, where it
had counted it once. A floor is arithmetic on what a run measured (times, the copy and GEMM rates) and on the
model's bytes, so the committed runs need no new measurement: `engine.json`'s fractions of the floor are recomputed
from its own times and floor, and `h200_gpu.json`'s decode floors from its own copy rate and the 0.8B model's bytes
(counted here, on random weights in bfloat16, as the floor part counts them). Each is checked first: the old rule
must give back the floors the file holds (so it runs once: a second run finds the new floors and stops). Both
figures are drawn again.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

from a4.bench import engine, gpu, write_report
from a4.bench._floor import ModelBytes
from a4.checkpoints import make_checkpoint
from a4.models.registry import load_model

REPORT_DIR = Path(__file__).parent


def state_read_once(model_bytes: ModelBytes) -> ModelBytes:
    """The old rule's bytes: with half the state, decode_bytes counts the whole state once."""
    return replace(model_bytes, state_bytes_per_request=model_bytes.state_bytes_per_request / 2)


def refloor_engine() -> None:
    path = REPORT_DIR / "engine.json"
    report = json.loads(path.read_text())
    workload = engine.Workload(**report["workload"])
    for result in report["results"].values():
        floor = result["floor"]
        read_once = {**floor, "state_bytes_per_request": floor["state_bytes_per_request"] / 2}
        for name in engine.SYSTEMS:
            old = engine.fraction_of_floor(result["tokens_per_s"][name], read_once, workload)
            assert all(math.isclose(old[step], result["fraction_of_floor"][name][step], rel_tol=1e-9) for step in old)
        fractions = {name: engine.fraction_of_floor(result["tokens_per_s"][name], floor, workload)
                     for name in engine.SYSTEMS}  # fmt: skip
        print(f"engine.json {floor['bytes_per_param'] * 8}-bit:", {
            name: {step: f"{old:.1%} -> {fractions[name][step]:.1%}" for step, old in steps.items()}
            for name, steps in result["fraction_of_floor"].items()
        })  # fmt: skip
        result["fraction_of_floor"] = fractions
    write_report(REPORT_DIR, "engine", report, engine.plot)


def refloor_gpu() -> None:
    path = REPORT_DIR / "h200_gpu.json"
    report = json.loads(path.read_text())
    workload = gpu.Workload.full()
    model_dir = make_checkpoint(None, "qwen3_5", preset=workload.preset, weights=False)
    config, model, _ = load_model(model_dir, dtype=gpu.DTYPE, device="cpu", progress=False, load_format="dummy")
    model_bytes = ModelBytes.of(model, config, gpu.DTYPE)
    floor = report["floor"]
    assert model_bytes.weight_bytes == floor["weight_bytes"], "not the model the report measured"
    old = gpu.decode_floor_ms(state_read_once(model_bytes), workload.batches, workload, floor)
    assert all(math.isclose(old[b], floor["decode_floor_ms"][b], rel_tol=1e-9) for b in old), "not the file's floors"
    floor["decode_floor_ms"] = gpu.decode_floor_ms(model_bytes, workload.batches, workload, floor)
    print("h200_gpu.json decode floors (ms):", {b: f"{old[b]:.3f} -> {floor['decode_floor_ms'][b]:.3f}" for b in old})
    report["launch_profile"] = gpu.with_floors(report["launch_profile"], floor)
    write_report(REPORT_DIR, "h200_gpu", report, gpu.plot)


if __name__ == "__main__":
    refloor_engine()
    refloor_gpu()
