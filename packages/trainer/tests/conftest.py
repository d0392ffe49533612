"""Fixtures: a tiny local model with the built-in character tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))
