"""The `wllm` command. Subcommands import their dependencies lazily, so `wllm --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from wllm.version import __version__

# Subcommands provided by other modules: each exposes register(subparsers).
_PLUGGED = (
    "wllm.entrypoints.serve_cli",
    "wllm.entrypoints.config_cli",
    "wllm.entrypoints.service_cli",
    "wllm.entrypoints.generate_cli",
    "wllm.entrypoints.bench_cli",
)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from wllm import doctor

    return doctor.run(as_json=args.json)


def _cmd_pull(args: argparse.Namespace) -> int:
    from wllm.model.default_model import DefaultModelError, default_model_path

    try:
        path = default_model_path(download=True)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wllm", description="wLLM: LLM inference server with prebuilt CUDA kernels")
    parser.add_argument("--version", action="version", version=f"wllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="check Python, PyTorch, the GPU and the kernel library")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_cmd_doctor)

    pull = sub.add_parser("pull", help="download the embedded default model (SmolLM2-135M-Instruct GGUF)")
    pull.set_defaults(func=_cmd_pull)

    for module_name in _PLUGGED:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # which flags were given, for the config file's precedence (wllm/settings.py)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
