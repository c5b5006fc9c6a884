"""Fixtures of the structured-output and tool-call tests: the embedded model in-process (one torch thread) and a
grammar compiler for its tokenizer, shared by the module-scoped tests of this folder."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine
from service.engine.grammar import GrammarCompiler


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None)


@pytest.fixture(scope="module")
def compiler(engine):
    return GrammarCompiler(engine.tokenizer, engine.spec.vocab_size, engine.spec.eos_ids)
