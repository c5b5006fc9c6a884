"""Subcommands of ``python -m service``; each module has ``add_parser(subparsers)``."""
