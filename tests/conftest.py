"""The suite's own redis-server: started once per pytest run on a free port in a temporary directory (no
persistence), so no test ever reads or writes a Redis the user runs (6379 or any other). Tests reach it through
``tests.support.processes.SHARED_REDIS_URL``; ``DLLM_TEST_REDIS_URL`` set beforehand names another one instead.

Triton's interpreter (``TRITON_INTERPRET=1``) is how the fused attention kernels (`service.quant.kernels`) run on
CPU tensors. Triton reads the variable when it decorates a kernel, its own standard library included, which is
decorated the moment anything first imports ``triton`` (loading a model does, through transformers), so it is
set here, before any test module is imported, and only where no GPU is present: a GPU host runs the same tests
with the compiled kernels.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.processes import TEST_REDIS_ENV, RedisProcess

_own: dict[str, object] = {}

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    if os.environ.get(TEST_REDIS_ENV) or shutil.which("redis-server") is None:
        return  # named by the caller, or absent: the tests that need it fail saying how to install it
    workdir = Path(tempfile.mkdtemp(prefix="dllm-kvq-test-redis-"))
    server = RedisProcess(workdir)
    server.start()
    _own.update(server=server, workdir=workdir)
    os.environ[TEST_REDIS_ENV] = server.url  # also for the processes the tests start


def pytest_collection_modifyitems(config, items) -> None:
    """The tier is a marker, not a folder: every test not marked ``integration`` is a ``unit`` test."""
    for item in items:
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)


def pytest_unconfigure(config) -> None:
    server = _own.pop("server", None)
    if server is not None:
        server.stop()
        os.environ.pop(TEST_REDIS_ENV, None)
        shutil.rmtree(_own.pop("workdir"), ignore_errors=True)
