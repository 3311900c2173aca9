"""Shared fixtures: tiny random-init checkpoints saved once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.kernels import cpu_build
from tests.tiny_models import save_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_target(model_dir: Path) -> Path:
    """A 2-layer Llama (GQA 4/2, vocab 320, float32) with the shared tiny tokenizer."""
    return save_model(model_dir / "target", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft(model_dir: Path) -> Path:
    """A 1-layer Llama with a different random init: a poor but valid draft for tiny_target."""
    return save_model(model_dir / "draft", "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(params=[isa for isa in cpu_build.ISAS if isa != "torch"])
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each C-kernel path of cpu_build (amx, avx512, avx2, portable), forced through
    SPECSERVE_CPU_ISA; skipped where this CPU cannot run it or no C compiler exists."""
    isa = request.param
    if isa not in cpu_build.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    if cpu_build.c_compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("SPECSERVE_CPU_ISA", isa)
    cpu_build.selected_isa.cache_clear()
    request.addfinalizer(cpu_build.selected_isa.cache_clear)
    assert cpu_build.library() is not None, f"the {isa} kernels failed to build"
    return isa
