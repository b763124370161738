"""The TOML config file of `wllm serve`: keys derived from the flags, precedence, clear errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from wllm import settings
from wllm.cli import build_parser, main
from wllm.settings import ConfigError, keys, load_file, resolve


def write(tmp_path: Path, text: str, name: str = "wllm.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_every_serve_flag_has_a_key_with_the_flags_type() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    dests = {a.dest for a in serve._actions if a.dest not in ("help", "config")}
    known = keys()
    assert set(known) == dests
    assert known["max_num_seqs"].name == "max-num-seqs" and known["max_num_seqs"].kind is int
    assert known["async_scheduling"].kind is bool and known["async_scheduling"].default is True
    assert known["gpu_memory_utilization"].kind is float and known["host"].kind is str
    assert known["api_key"].repeated and known["cors_origin"].repeated and not known["port"].repeated
    assert known["log_format"].choices == ("text", "json")
    assert known["model"].name == "model" and known["engine_process"].default is None


def test_a_new_flag_becomes_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from wllm.entrypoints import serve_cli

    original = serve_cli.add_serve_arguments

    def with_extra(p: argparse.ArgumentParser) -> None:
        original(p)
        p.add_argument("--brand-new-knob", type=serve_cli._positive_int, default=3)

    monkeypatch.setattr(serve_cli, "add_serve_arguments", with_extra)
    assert keys()["brand_new_knob"].kind is int


def test_values_are_checked_like_the_flags(tmp_path: Path) -> None:
    good = write(
        tmp_path,
        "port = 9000\ngpu-memory-utilization = 1\nasync-scheduling = false\n"
        'served-model-name = "one"\ncors-origin = ["https://a", "https://b"]\n',
    )
    values = load_file(good)
    assert values == {
        "port": 9000,
        "gpu_memory_utilization": 1.0,
        "async_scheduling": False,
        "served_model_name": ["one"],
        "cors_origin": ["https://a", "https://b"],
    }
    bad = {
        'port = "8000"': "key 'port' must be an integer, got a string",
        "port = true": "key 'port' must be an integer, got a boolean",
        'enforce-eager = "yes"': "key 'enforce-eager' must be true or false",
        "max-num-seqs = 0": "key 'max-num-seqs': must be a positive integer",
        'log-format = "xml"': "key 'log-format' must be one of text, json",
        "cors-origin = [1]": "key 'cors-origin' must be a string or a list of them",
        "max-num-seq = 4": "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)",
        "[serve]\nport = 1": "unknown key 'serve'",
        "port = ": "not valid TOML",
    }
    for text, message in bad.items():
        path = write(tmp_path, text + "\n", "bad.toml")
        with pytest.raises(ConfigError) as err:
            load_file(path)
        assert message in str(err.value) and str(path) in str(err.value), text
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_file(tmp_path / "missing.toml")


def test_flag_beats_file_beats_env_beats_default(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 9000\nhost = "0.0.0.0"\napi-key = ["sk-file"]\n')
    env = {"WLLM_API_KEY": "sk-env"}
    got = resolve({"port": 8000}, path, env)  # a flag equal to the default still wins over the file
    assert (got["port"].value, got["port"].source, got["port"].origin) == (8000, "flag", "--port")
    assert (got["host"].value, got["host"].source) == ("0.0.0.0", "file")
    assert (got["api_key"].value, got["api_key"].source) == (["sk-file"], "file")
    assert (got["max_num_seqs"].value, got["max_num_seqs"].source) == (256, "default")
    no_file = resolve({}, None, {"WLLM_API_KEYS": "sk-a, sk-b"})
    assert (no_file["api_key"].value, no_file["api_key"].source) == (["sk-a", "sk-b"], "env")


def test_the_command_line_decides_what_is_a_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "port = 9000\nmax-num-seqs = 8\n")
    argv = ["serve", "--config", str(path), "--port", "8000", "m.gguf"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    got = settings.effective(args, environ={})
    assert got["port"].source == "flag" and got["port"].value == 8000
    assert got["max_num_seqs"].source == "file" and got["model"].value == "m.gguf"
    merged = settings.apply(args, got)
    assert (merged.port, merged.max_num_seqs, merged.func) == (8000, 8, args.func)
    # Without the command line (a Namespace built in code), values other than the default are flags.
    args = build_parser().parse_args(["serve", "--config", str(path), "--max-num-seqs", "2"])
    got = settings.effective(args, environ={})
    assert got["max_num_seqs"].value == 2 and got["port"].value == 9000


def test_relative_paths_in_the_file_are_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")
    path = write(tmp_path, 'model = "m.gguf"\napi-key-file = "keys.txt"\ntokenizer = "org/tok"\n')
    values = load_file(path)
    assert values["model"] == str(tmp_path / "m.gguf") and values["api_key_file"] == str(tmp_path / "keys.txt")
    assert values["tokenizer"] == "org/tok"  # not a path here: a hub id stays as written


def test_config_show_prints_a_config_file_with_sources(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WLLM_API_KEY", "sk-secret")
    path = write(tmp_path, 'served-model-name = ["a", "b"]\nmax-num-seqs = 4\n')
    assert main(["config", "show", "--config", str(path), "--port", "8123"]) == 0
    out = capsys.readouterr().out
    assert "sk-secret" not in out and "api-key = <1 key(s), hidden>" in out and "# env (WLLM_API_KEY" in out
    lines = {line.split("=")[0].strip("# ").strip(): line for line in out.splitlines() if "=" in line}
    assert lines["port"].startswith("port = 8123") and lines["port"].endswith("# flag")
    assert lines["served-model-name"].startswith('served-model-name = ["a", "b"]') and f"file ({path})" in out
    assert lines["host"].endswith("# default")
    # What it prints (less the hidden key) is a config file that loads back to the same values.
    printed = write(tmp_path, out, "printed.toml")
    values = load_file(printed)
    assert values["port"] == 8123 and values["served_model_name"] == ["a", "b"] and values["max_num_seqs"] == 4


def test_bad_config_is_a_clear_cli_error_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "max-num-seqs = -1\n")
    for command in (["serve"], ["config", "show"]):
        proc = subprocess.run(
            [sys.executable, "-m", "wllm", *command, "--config", str(path)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr
        assert f"error: {path}: key 'max-num-seqs'" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_reads_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The key file named by the config (relative to it) is what serve then fails to read: before any model loads.
    path = write(tmp_path, 'api-key-file = "no-keys.txt"\n')
    assert main(["serve", "--config", str(path)]) == 2
    assert f"cannot read API key file {tmp_path / 'no-keys.txt'}" in capsys.readouterr().err
