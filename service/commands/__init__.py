"""Subcommands of ``python -m service``; each module exposes ``add_parser(subparsers)`` (see `service.__main__`)."""

import argparse

from pydantic import ValidationError

from service.store.base import InvalidName, check_store_url


def describe_validation_error(exc: ValidationError) -> str:
    """One ``field: reason`` per error, WITHOUT the input values or pydantic's documentation links: its own
    message repeats what it was given (admin and API keys included, for settings) into terminals and logs."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)


def store_url_arg(value: str) -> str:
    """argparse ``type`` of a ``--store`` flag: an unknown URL scheme is a one-line usage error naming the flag."""
    try:
        check_store_url(value)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value
