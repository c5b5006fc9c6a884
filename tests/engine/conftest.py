"""Fixtures of the engine tests: the two tiny checkpoints loaded once, one torch thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.fastdllm import CKPT
from tests.support.fastdllm import llada_with_tokenizer as _llada_with_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The goldens were made with one torch thread; the shared machine is also fastest this way.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def engines():
    from service.engine import Engine

    return {arch: Engine.load(path) for arch, path in CKPT.items()}


@pytest.fixture(scope="session")
def llada_with_tokenizer(tmp_path_factory) -> Path:
    return _llada_with_tokenizer(tmp_path_factory.mktemp("llada-tok"))
