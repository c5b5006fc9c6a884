"""``dllm-kvq serve|generate|policies|calibrate|evaluate ...``: the installed console command.

It only dispatches, so the ``python -m`` forms stay equivalent: ``serve``, ``generate`` and ``policies`` are
``python -m service <command>``; ``calibrate`` is ``python -m calibration``; ``evaluate`` is
``python -m evaluation``. It lives in its own package because it sits above all three (``service`` never imports
``calibration`` or ``evaluation``; see docs/architecture.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

USAGE = """usage: dllm-kvq <command> [args ...]

commands:
  serve       start the OpenAI-compatible server            (python -m service serve)
  generate    decode from the command line                  (python -m service generate)
  policies    list, show, activate, diff, audit, export     (python -m service policies)
  calibrate   TRACE, diagnostics, policy and KVQuant fits   (python -m calibration)
  evaluate    lm-eval, the result matrix, score pushing     (python -m evaluation)

'dllm-kvq <command> --help' describes a command; 'dllm-kvq --version' prints the version."""


def _service(command: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from service.__main__ import main

        return main([command, *argv])

    return run


def _calibrate(argv: list[str]) -> int:
    from calibration.cli import main

    return main(argv)


def _evaluate(argv: list[str]) -> int:
    from evaluation.cli import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "serve": _service("serve"),
    "generate": _service("generate"),
    "policies": _service("policies"),
    "calibrate": _calibrate,
    "evaluate": _evaluate,
}


def main(argv: list[str] | None = None) -> int:
    """Run ``dllm-kvq <command> [args]``; returns the command's exit code (2 with the usage for an unknown one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"dllm-kvq {version('dllm-kvq')}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"dllm-kvq: unknown command {argv[0]!r}; legal: {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    import service.commands

    # Usage lines and errors name the command as the user typed it (`.venv/bin/dllm-kvq`).
    typed = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "dllm-kvq" else "dllm-kvq"
    service.commands.console = service.commands.runnable(typed)
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
