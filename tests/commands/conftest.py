"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fastdllm import llada_with_tokenizer as _llada_with_tokenizer


@pytest.fixture(scope="session")
def llada_with_tokenizer(tmp_path_factory) -> Path:
    return _llada_with_tokenizer(tmp_path_factory.mktemp("llada-tok"))
