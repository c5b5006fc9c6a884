"""``python -m service <command> ...``: one subcommand per module of `service.commands`.

Each module there (but a private one, ``_name``: a part of a command) exposes ``add_parser(subparsers)``, which adds its subparser and sets ``func`` (called with the
parsed namespace, returns the exit code). Modules import heavy dependencies inside ``func`` so that ``--help`` of any
command stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import service.commands
from service.commands import prog


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command found in `service.commands`."""
    parser = argparse.ArgumentParser(prog=prog("service"), description="dllm-kvq: serve and run diffusion LMs")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for module in sorted(info.name for info in pkgutil.iter_modules(service.commands.__path__)
                         if not info.name.startswith("_")):
        importlib.import_module(f"service.commands.{module}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the chosen command; returns its exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
