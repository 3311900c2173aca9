"""Shared fixtures: tiny random-init checkpoints saved once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

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
