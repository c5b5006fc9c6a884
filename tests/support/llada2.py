"""The LLaDA2 golden data shipped under tests/data/llada2 (see its README): checkpoints and reference outputs."""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

import numpy as np
import torch

from tests.support.paths import DATA

LLADA2_DATA = DATA / "llada2"
#: family -> tiny checkpoint directory (2.0 and the 2.1 copy; the same weights).
LLADA2_CKPT = {"llada2": LLADA2_DATA / "llada2-tiny", "llada21": LLADA2_DATA / "llada21-tiny"}
#: llada2-tiny with a word-level tokenizer and a chat template (scripts/make_llada2_tiny_chat.py wrote it): what
#: the served tests and docs/llada2.md serve as text.
LLADA2_CHAT = LLADA2_DATA / "llada2-tiny-chat"


@cache
def llada2_golden(name: str) -> dict:
    """One golden file of tests/data/llada2, parsed once."""
    return json.loads((LLADA2_DATA / name).read_text())


def reference_logits(case: dict) -> torch.Tensor:
    """float32 ``[T, V]`` logits of one forward case (base64 little-endian, row-major)."""
    raw = np.frombuffer(base64.b64decode(case["logits"]), dtype="<f4")
    return torch.from_numpy(raw.reshape(case["shape"]).copy())


def start_llada2_server(checkpoint: Path, work: Path, **env: str):
    """A started `tests.support.processes.ServerProcess` serving ``checkpoint`` (one torch thread, its store and
    log under ``work``; ``env``: more ``DLLM_*`` settings). The caller stops it."""
    from tests.support.processes import ServerProcess

    settings = {"DLLM_MODEL": str(checkpoint), "DLLM_STORE_URL": str(work / "store"), "DLLM_THREADS": "1", **env}
    return ServerProcess(settings, log_path=work / "server.log").start(timeout_s=180)
