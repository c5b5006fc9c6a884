"""The process guard of tests/conftest.py (issue 41): a unit test (not marked ``integration``) may let a kernel
compiler or the CUDA runtime start its helper programs (Triton's ``/sbin/ldconfig -p``, ``cc`` for its launcher),
but neither those programs started by the test's own code nor any other program started by a compiler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

triton = pytest.importorskip("triton")


def _from_module(module: str, start) -> None:
    """Call ``start`` as code of ``module`` (its frame's globals carry that ``__name__``), as a compiler's own call
    would start a process."""
    types.FunctionType(start.__code__, {"__name__": module, "subprocess": subprocess, "sys": sys})()


def _cc() -> None:
    subprocess.run(["cc", "--version"], stdout=subprocess.DEVNULL, check=False)


def _python() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_triton_s_own_ldconfig_passes_the_guard():
    """Triton's NVIDIA driver looks for libcuda with ``/sbin/ldconfig -p`` (the real function, uncached): the
    guard lets it start; without a GPU the function then finds no libcuda and says so (an AssertionError of its
    own), which is past the guard."""
    from triton import knobs
    from triton.backends.nvidia.driver import libcuda_dirs

    if knobs.nvidia.libcuda_path:
        pytest.skip("TRITON_LIBCUDA_PATH is set: Triton starts no ldconfig")
    if not os.path.exists("/sbin/ldconfig"):
        pytest.skip("no /sbin/ldconfig on this host")
    try:
        dirs = libcuda_dirs.__wrapped__()
    except AssertionError as exc:  # no libcuda here: Triton's own message, after ldconfig ran
        assert "libcuda.so cannot found" in str(exc)
    else:
        assert isinstance(dirs, list)


def test_a_compiler_s_cc_passes_the_guard():
    """A C compiler started from Triton's code (its launcher build) passes; the compile itself runs."""
    _from_module("triton.runtime.build", _cc)


def test_the_same_program_from_the_test_itself_fails():
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        subprocess.run(["ldconfig", "-p"], stdout=subprocess.DEVNULL, check=False)


def test_an_arbitrary_program_from_a_compiler_fails():
    """The door opens by name and by caller: a program outside the compiler's tools fails even from Triton."""
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        _from_module("triton.runtime.build", _python)


def test_a_compiler_tool_from_another_package_fails():
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        _from_module("tritonish.helpers", _cc)
