"""Tiny Fast-dLLM checkpoints and goldens (tests/data/fastdllm) shared by the engine tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import llada_tiny_with_tokenizer

DATA = Path(__file__).resolve().parent.parent / "data" / "fastdllm"
CKPT = {"llada": DATA / "ckpt" / "llada-tiny", "dream": DATA / "ckpt" / "dream-tiny"}


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The goldens were made with one torch thread; the shared machine is also fastest this way.
    torch.set_num_threads(1)


def golden(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="session")
def engines():
    from service.engine import Engine

    return {arch: Engine.load(path) for arch, path in CKPT.items()}


@pytest.fixture(scope="session")
def llada_with_tokenizer(tmp_path_factory) -> Path:
    """llada-tiny plus a word-level tokenizer (EOS 81, end-of-turn 348, mask 336, header tokens 346/347)."""
    return llada_tiny_with_tokenizer(tmp_path_factory.mktemp("llada-tok"))
