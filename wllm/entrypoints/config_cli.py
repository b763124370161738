"""`wllm config show [--config FILE] [serve flags]`: the settings `wllm serve` would run with, and where
each comes from (default, env, file or flag), printed as a TOML config file."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `config` subcommand to the `wllm` CLI."""
    p = subparsers.add_parser("config", help="show the effective `wllm serve` settings and their sources")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser(
        "show",
        help="print the effective settings (a valid config file) with each one's source",
        description="Print the settings `wllm serve` would use with these arguments, as a TOML config file; "
        "after each, its source: default, env, file or flag.",
    )
    show.add_argument("--config", default=None, metavar="FILE", help="TOML config file, as for `wllm serve`")
    from wllm.entrypoints.serve_cli import add_serve_arguments

    add_serve_arguments(show)
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    from wllm.settings import ConfigError, effective, format_settings

    try:
        settings = effective(args, command_words=2)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_settings(settings))
    return 0
