"""The reference environment: transformers' PyTorch code paths for Qwen3.5, no kernel packages that replace them."""

import importlib.util
import sys

import pytest
import transformers

from a4.reference import ReferenceEnvironmentError, assert_reference_environment


@pytest.mark.parametrize("module", ["fla", "causal_conv1d"])
def test_kernel_packages_not_importable(module):
    # Either would make transformers swap its GDN / causal-conv PyTorch code for a kernel with other numerics.
    assert importlib.util.find_spec(module) is None, f"{module} is installed: uninstall it"


def test_transformers_knows_qwen3_5():
    for model_type in ("qwen3", "qwen3_5", "qwen3_5_moe"):
        assert model_type in transformers.CONFIG_MAPPING, model_type
    assert hasattr(transformers, "Qwen3_5ForConditionalGeneration")
    assert hasattr(transformers, "Qwen3_5MoeForConditionalGeneration")


def test_reference_refuses_kernel_packages(tmp_path, monkeypatch):
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    with pytest.raises(ReferenceEnvironmentError, match="fla"):
        assert_reference_environment()
