"""Subcommands of ``python -m service``; each module exposes ``add_parser(subparsers)`` (see `service.__main__`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

if TYPE_CHECKING:  # pydantic is imported by the callers that have fields; --help of a command stays light
    from pydantic import ValidationError
    from pydantic.fields import FieldInfo

#: The console command as the user can type it again while it dispatches (`dllm_kvq.cli` sets it, `runnable`),
#: else None (a ``python -m`` form).
console: str | None = None
#: The console subcommand that runs each ``python -m`` package (``dllm-kvq calibrate`` is ``python -m calibration``).
CONSOLE_SUBCOMMAND = {"service": "", "calibration": "calibrate", "evaluation": "evaluate"}


def runnable(path: str) -> str:
    """A program path as a user can type it in this shell: as given when relative (``.venv/bin/dllm-kvq``), the
    bare name when its folder is on ``PATH`` (an activated venv), else relative to the working directory when
    inside it, else absolute."""
    if not os.path.isabs(path):
        return path
    folders = [os.path.realpath(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if os.path.realpath(os.path.dirname(path)) in folders:
        return os.path.basename(path)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def prog(package: str, *words: str) -> str:
    """How the user invoked ``package``'s command, for argparse's ``prog`` (usage lines) and messages that name a
    command, in a form that runs again (`runnable`): ``.venv/bin/dllm-kvq calibrate`` under the console command,
    else ``.venv/bin/python -m calibration`` (``python -m calibration`` with the venv active); ``words`` (a verb)
    follow."""
    head = (f"{console} {CONSOLE_SUBCOMMAND[package]}".strip() if console
            else f"{runnable(sys.executable)} -m {package}")
    return " ".join([head, *words])


def describe_validation_error(exc: ValidationError) -> str:
    """One ``field: reason`` per error, WITHOUT the input values or pydantic's documentation links: its own
    message repeats what it was given (admin and API keys included, for settings) into terminals and logs."""
    from service.engine.errors import validation_message

    lines = []
    for error in exc.errors(include_url=False, include_input=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        lines.append(f"{where}: {validation_message(error)}")
    return "; ".join(lines)


def add_model_flags(parser: argparse.ArgumentParser | Any, fields: dict[str, FieldInfo],
                    show_default: bool = False) -> None:
    """One flag per pydantic field (``serve`` for `Settings`, ``generate`` for `DecodeSettings`): ``--a-name``
    into ``args.a_name``, default None (= not given, the model's default applies), help from the field's
    description; a bool is ``--x`` / ``--no-x``, a ``Literal`` lists its choices. Values stay strings and are
    validated by the model (pydantic's lax mode parses ``"32"`` and ``"0.9"``)."""
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        # A field without a default whose description already says what its absence means keeps that alone.
        if show_default and not (field.default is None and "default" in help_text):
            help_text = f"{help_text} (default {_shown_default(field)})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        literal = get_origin(field.annotation) is Literal
        parser.add_argument(flag, dest=name, default=None, help=help_text,
                            choices=list(get_args(field.annotation)) if literal else None,
                            metavar=None if literal else name.upper())


def _shown_default(field: FieldInfo) -> str:
    """A field's built-in default as help shows it (``unset`` for None; a structured default as its JSON)."""
    if field.default_factory is not None:
        if isinstance(field.default_factory, type) and hasattr(field.default_factory, "model_fields"):
            # A settings model: not built here (building one may import torch, and --help must stay light).
            return "{}, every field at its default"
        value = field.default_factory()
        return "empty" if not value else str(value)
    if field.default is None:
        return "unset"
    dump = getattr(field.default, "model_dump_json", None)
    return dump(exclude_none=True) if dump else str(field.default)


def store_url_arg(value: str) -> str:
    """argparse ``type`` of a ``--store`` flag: an unknown URL scheme is a one-line usage error naming the flag."""
    from service.store.base import InvalidName, check_store_url  # here: the store module imports torch

    try:
        check_store_url(value)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value
