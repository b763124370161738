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
    if args.model is None:
        from wllm.model.default_model import DefaultModelError, default_model_path

        try:
            path = default_model_path(download=True)
        except DefaultModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        from wllm.model.loader.errors import ModelLoadError
        from wllm.model.loader.hf_source import parse_hub_ref, resolve_source

        if parse_hub_ref(args.model) is None:
            print(f"error: {args.model}: not a hub repository like 'org/name' or 'org/name:FILE.gguf'", file=sys.stderr)
            return 2
        try:  # huggingface_hub shows the progress, resumes partial files and keeps them in its cache
            path = resolve_source(args.model, args.revision).path
        except ModelLoadError as exc:
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

    pull = sub.add_parser(
        "pull",
        help="download a model from the Hugging Face Hub into its cache (default: the embedded SmolLM2)",
        description="Download a model into the Hugging Face cache, so `wllm serve MODEL` then starts offline. "
        "MODEL: org/name (its safetensors, or its GGUF: Q4_K_M when it has several), "
        "org/name:FILE.gguf, or org/name:TAG (a quantization such as Q8_0). Without MODEL: the "
        "embedded SmolLM2-135M-Instruct.",
    )
    pull.add_argument("model", nargs="?", default=None, metavar="MODEL")
    pull.add_argument("--revision", default=None, help="branch, tag or commit")
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
