"""``python -m service <command>``: one subcommand per module in `service.commands`, each with
``add_parser(subparsers)`` that registers its parser and sets ``func`` (called with the parsed arguments; its
return value is the exit code)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from service import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for module in sorted(m.name for m in pkgutil.iter_modules(commands.__path__)):
        importlib.import_module(f"service.commands.{module}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
