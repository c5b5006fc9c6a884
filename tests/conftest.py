"""The suite's own redis-server: started once per pytest run on a free port in a temporary directory (no
persistence), so no test ever reads or writes a Redis the user runs (6379 or any other). Tests reach it through
``tests.support.processes.SHARED_REDIS_URL``; ``DLLM_TEST_REDIS_URL`` set beforehand names another one instead.

Triton's interpreter (``TRITON_INTERPRET=1``) is how the fused attention kernels (`service.quant.kernels`) run on
CPU tensors. Triton reads the variable when it decorates a kernel, its own standard library included, which is
decorated the moment anything first imports ``triton`` (loading a model does, through transformers), so it is
set here, before any test module is imported, and only where no GPU is present: a GPU host runs the same tests
with the compiled kernels.

The tiers (docs/testing.md) are markers, and the markers are kept honest here: a test not marked ``integration``
that starts a child process (a server, a fresh interpreter, a shell script, lm-eval over HTTP) fails, saying to
mark it, so the fast tier (``scripts/test.sh --fast``: ``-m "not integration and not slow"``) never waits on a
process start-up. The exceptions are the short-lived native tools in :data:`FAST_TOOLS`, and what a kernel
compiler or the CUDA runtime starts while a test compiles a kernel (:data:`COMPILER_TOOLS`, started from the code
of :data:`COMPILER_MODULES` only; issue 41: on a GPU host Triton's NVIDIA driver runs ``/sbin/ldconfig -p`` to find
libcuda and builds its launcher with ``cc``, which failed 20 of the 21 compiled-kernel tests): a test that compiles
a kernel is a unit test, and the door opens for those programs by name and by caller, for nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.processes import TEST_REDIS_ENV, RedisProcess, ServerProcess

_own: dict[str, object] = {}

#: Executables a test outside the ``integration`` tier may start: native command-line checkers that start no
#: server and no Python interpreter and end in well under a second.
FAST_TOOLS = frozenset({"docker-compose", "git", "hadolint", "promtool"})
#: Programs a kernel compiler or the CUDA runtime starts while it builds a kernel: the linker cache (Triton's
#: ``libcuda_dirs``: ``/sbin/ldconfig -p``), the CPU's description (``lscpu``), a C compiler for Triton's launcher
#: (``triton/runtime/build.py``: ``cc``, or ``$CC``) and CUDA's own tools (``ptxas``, ``nvcc``, ``cuobjdump``,
#: ``nvdisasm``, ``nvlink``, ``fatbinary``). Let through only when started from :data:`COMPILER_MODULES`' code.
COMPILER_TOOLS = frozenset({"ldconfig", "lscpu", "cc", "gcc", "g++", "c++", "clang", "clang++", "nvcc", "ptxas",
                            "cuobjdump", "nvdisasm", "nvlink", "fatbinary"})
#: Modules (and their submodules) whose code is a compiler or the CUDA runtime: Triton, TorchInductor, torch's
#: C++/CUDA extension builder and ``torch.cuda``.
COMPILER_MODULES = ("triton", "torch._inductor", "torch.utils.cpp_extension", "torch.cuda")

#: The test whose setup, call or teardown is running now (None between tests and in session hooks).
_running: dict[str, pytest.Item | None] = {"item": None}
_popen_init = subprocess.Popen.__init__


def _started_by_compiler(program: str) -> bool:
    """Whether a process of ``program`` (its file name) is being started by a compiler or the CUDA runtime: the
    program is one of :data:`COMPILER_TOOLS` and a frame of the calling stack runs code of
    :data:`COMPILER_MODULES` (the module the frame's code was defined in, ``__name__``)."""
    if program not in COMPILER_TOOLS:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if any(name == m or name.startswith(m + ".") for m in COMPILER_MODULES):
            return True
        frame = frame.f_back
    return False


def _popen_init_outside_integration(self, args, *rest, **kwargs):
    item = _running["item"]
    if item is not None and item.get_closest_marker("integration") is None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        program = os.path.basename(str(argv[0]).split()[0]) if argv else ""
        if program not in FAST_TOOLS and not _started_by_compiler(program):
            # Failed is a BaseException: an ``except Exception`` in the code under test does not swallow it.
            pytest.fail(f"{item.nodeid} starts a process ({str(args)[:160]}) but is not marked integration; mark "
                        "it @pytest.mark.integration (or run it in this process: tests/support/cli.py)",
                        pytrace=False)
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _popen_init_outside_integration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Remember the running test for the process check above."""
    _running["item"] = item
    try:
        yield
    finally:
        _running["item"] = None

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The settings read the working directory's .env (`service.config.env_file`): a developer's copy for compose (the
# 8B model on cuda) must not change what the suite's settings and servers are; tests of the env file set it.
os.environ["DLLM_ENV_FILE"] = ""


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


@pytest.fixture(scope="session")
def shared_embedded_server(tmp_path_factory):
    """One ``python -m service serve`` of the embedded default model (one torch thread, a directory store, default
    settings) for the black-box API tests that need no settings of their own, instead of one start-up per module
    (per xdist worker: each worker has its own session). Tests reading its counters compare before and after;
    tests that change its state (activation, keys, stop) start their own server."""
    tmp = tmp_path_factory.mktemp("shared-embedded")
    srv = ServerProcess({"DLLM_STORE_URL": str(tmp / "store"), "DLLM_THREADS": "1"},
                        log_path=tmp / "server.log").start(timeout_s=180)
    yield srv
    srv.stop()
