"""Subcommands of ``python -m service``; each module exposes ``add_parser(subparsers)`` (see `service.__main__`)."""

from pydantic import ValidationError


def describe_validation_error(exc: ValidationError) -> str:
    """One ``field: reason`` per error, WITHOUT the input values or pydantic's documentation links: its own
    message repeats what it was given (admin and API keys included, for settings) into terminals and logs."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {error['msg']}")
    return "; ".join(lines)
