"""Subcommands of ``python -m service``; each module exposes ``add_parser(subparsers)`` (see `service.__main__`)."""
