"""``python -m service ...`` run in this process: the same ``main`` a subprocess runs, its exit status and both
streams, without a fresh interpreter (importing torch and the service again costs seconds per call).

Each command keeps at least one test that starts a real subprocess (``tests/commands``); the others call
:func:`service_main`, which differs from a subprocess only where no user looks: the process's torch threads and
imported modules are shared with the test, and an exception that escapes ``main`` fails the test with its traceback
instead of exiting 1.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def _environ(overrides: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``overrides`` set for the block (restored after, also on error)."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def service_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m service *args`` in this process: ``CompletedProcess(args, returncode, stdout, stderr)``.

    ``env`` is set in ``os.environ`` for the call only. argparse's usage errors (``SystemExit(2)``) and any other
    ``SystemExit`` become the return code, as the interpreter would make them.
    """
    from service.__main__ import main

    return _in_process(main, ["python", "-m", "service"], args, env)


def console_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``dllm-kvq *args`` (`dllm_kvq.cli.main`, every command) in this process, as :func:`service_main`."""
    import service.commands
    from dllm_kvq.cli import main

    # The console sets the program name the commands print (`service.commands.console`, a module global); a
    # later ``python -m`` form in this process must print its own again.
    typed = service.commands.console
    try:
        return _in_process(main, ["dllm-kvq"], args, env)
    finally:
        service.commands.console = typed


def _in_process(main, command: list[str], args: tuple[str, ...], env: dict[str, str] | None
                ) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with _environ(env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if isinstance(done.code, str):
                print(done.code, file=err)
    return subprocess.CompletedProcess([*command, *args], code, out.getvalue(), err.getvalue())
