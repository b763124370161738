"""`wllm serve`: flags, and clear errors (no traceback) for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wllm.cli import build_parser

FLAGS = ["--host", "--port", "--device", "--dtype", "--max-model-len", "--block-size", "--gpu-memory-utilization",
         "--swap-space", "--max-num-batched-tokens", "--max-num-seqs", "--max-queue", "--enable-prefix-caching",
         "--no-enable-prefix-caching", "--served-model-name", "--chat-template", "--api-key", "--api-key-file",
         "--rate-limit-rpm", "--rate-limit-tpm", "--cors-origin", "--log-format", "--otlp-endpoint",
         "--shutdown-timeout", "--tokenizer", "--load-format", "--max-body-size", "--enforce-eager",
         "--no-async-scheduling", "--engine-process", "--no-engine-process", "--stream-interval",
         "--metrics-auth", "--no-metrics-auth", "--max-prompt-chars", "--timeout-keep-alive", "--timeout-header",
         "--timeout-body", "--max-header-size", "--max-connections", "--ui", "--no-ui", "--tool-call-parser",
         "--reasoning-parser"]
CONFIGURATION_MD = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_help_documents_every_flag() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for flag in FLAGS:
        assert flag in text, flag


def test_connection_and_prompt_flags_have_documented_defaults() -> None:
    from wllm.entrypoints.openai.connections import ConnectionLimits
    from wllm.entrypoints.serve_cli import connection_limits

    args = serve_args()
    assert connection_limits(args) == ConnectionLimits(keep_alive_timeout=5.0, header_timeout=10.0,
                                                       body_timeout=60.0, max_header_bytes=64 * 1024,
                                                       max_connections=1024)
    assert args.max_prompt_chars is None and args.max_body_size == 16.0
    args = serve_args("--timeout-header", "2.5", "--timeout-body", "30", "--timeout-keep-alive", "1",
                      "--max-header-size", "16", "--max-connections", "10", "--max-prompt-chars", "1000")
    assert connection_limits(args) == ConnectionLimits(1.0, 2.5, 30.0, 16 * 1024, 10)
    assert args.max_prompt_chars == 1000
    docs = CONFIGURATION_MD.read_text(encoding="utf-8")
    for flag in ("--max-prompt-chars", "--timeout-keep-alive", "--timeout-header", "--timeout-body",
                 "--max-header-size", "--max-connections", "--max-body-size"):
        assert f"`{flag}" in docs, flag
    for bad in (["--timeout-header", "0"], ["--timeout-body", "-1"], ["--max-connections", "0"],
                ["--max-prompt-chars", "0"], ["--max-body-size", "0"], ["--timeout-keep-alive", "nan"]):
        with pytest.raises(SystemExit):
            serve_args(*bad)


def test_defaults_bind_localhost_8000_with_the_embedded_model() -> None:
    args = serve_args()
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8000)
    assert args.enable_prefix_caching is True and args.cors_origin == [] and args.api_key == []
    assert args.metrics_auth is False
    assert serve_args("--metrics-auth").metrics_auth is True
    assert serve_args("--metrics-auth", "--no-metrics-auth").metrics_auth is False
    args = serve_args("m.gguf", "--no-enable-prefix-caching", "--api-key", "a", "--api-key", "b",
                      "--cors-origin", "https://x")
    assert args.model == "m.gguf" and not args.enable_prefix_caching and args.api_key == ["a", "b"]


def test_the_engine_runs_in_its_own_process_on_cuda_unless_told_otherwise() -> None:
    from wllm.entrypoints.serve_cli import use_engine_process

    assert serve_args().engine_process is None
    assert serve_args("--engine-process").engine_process is True
    assert serve_args("--no-engine-process").engine_process is False
    assert use_engine_process(None, "cuda") and use_engine_process(None, "cuda:1")
    assert not use_engine_process(None, "cpu")
    assert use_engine_process(True, "cpu") and not use_engine_process(False, "cuda")


def test_bad_flag_values_are_rejected_by_argparse() -> None:
    with pytest.raises(SystemExit):
        serve_args("--max-num-seqs", "0")
    with pytest.raises(SystemExit):
        serve_args("--log-format", "xml")
    with pytest.raises(SystemExit):
        serve_args("--stream-interval", "0")
    with pytest.raises(SystemExit):
        serve_args("--tool-call-parser", "xml")
    with pytest.raises(SystemExit):
        serve_args("--reasoning-parser", "maybe")
    args = serve_args("--tool-call-parser", "hermes", "--reasoning-parser", "none")
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "none")
    assert (serve_args().tool_call_parser, serve_args().reasoning_parser) == ("auto", "auto")


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wllm.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_cli("--api-key-file", str(tmp_path / "nope.txt"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "cannot read API key file" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    proc = run_cli(str(missing), "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "no-such-model" in proc.stderr and "Traceback" not in proc.stderr
