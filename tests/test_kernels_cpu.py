"""`a4.kernels` where there is no GPU: importing it needs neither Triton nor flash-linear-attention, and the fla
prefill reports itself unavailable when fla cannot be imported (the kernels themselves: tests/test_gpu_kernels.py)."""

import sys

from a4.kernels.fla_prefill import fla_available


def test_kernels_package_and_fla_prefill_import_without_triton(run_python):
    result = run_python(
        "import sys, a4, a4.kernels, a4.kernels.fla_prefill\n"
        "print(sorted(m for m in ('triton', 'fla') if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_fla_unavailable_when_it_cannot_be_imported(monkeypatch):
    # A None entry in sys.modules makes `import fla` raise ImportError, as on a machine without the package.
    monkeypatch.setitem(sys.modules, "fla", None)
    fla_available.cache_clear()
    try:
        assert fla_available() is False
    finally:
        fla_available.cache_clear()
