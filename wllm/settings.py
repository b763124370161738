"""The settings of `wllm serve`: defaults, the environment, a TOML config file, flags.

One source of truth: the config file's keys are derived from the argparse definition of `wllm serve`
(`add_serve_arguments`): each destination with '-' for '_' (`--max-num-seqs` -> `max-num-seqs`,
`--no-async-scheduling` -> `async-scheduling = false`, MODEL -> `model`). A flag added there is a key
at once, with its type, choices and range check. Precedence, highest first: flag, file, environment,
default.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SOURCES = ("default", "env", "file", "flag")
# Keys holding paths: relative values in a config file are taken relative to the file's folder (a
# service starts in a folder of its manager's choosing). "exists": only when that path exists, since
# the value may also be a hub id or a template string.
PATH_KEYS = {"model": "exists", "tokenizer": "exists", "chat_template": "exists", "api_key_file": "always"}
SECRET_KEYS = {"api_key"}


class ConfigError(ValueError):
    """A bad config file or value; the message names the file and the key."""


@dataclass(frozen=True)
class Key:
    """One setting: its config-file name, argparse destination, type and flag."""

    name: str
    dest: str
    kind: type  # bool, int, float or str (of each item when repeated)
    repeated: bool
    choices: tuple[Any, ...] | None
    check: Callable[[str], Any] | None  # the flag's own type function (range checks), if not a plain type
    default: Any
    flag: str
    group: str


def env_api_keys(environ: Mapping[str, str]) -> list[str] | None:
    """Keys from WLLM_API_KEY and the comma-separated WLLM_API_KEYS; None when neither is set."""
    keys = [environ.get("WLLM_API_KEY", "").strip()]
    keys += [k.strip() for k in environ.get("WLLM_API_KEYS", "").split(",")]
    keys = [k for k in keys if k]
    return keys or None


# Destination -> (what it reads, the reader). These are all the environment variables `wllm serve`
# settings come from; the others it honours (WLLM_CACHE, HF_*) are not flags.
ENV_SOURCES: dict[str, tuple[str, Callable[[Mapping[str, str]], Any]]] = {
    "api_key": ("WLLM_API_KEY / WLLM_API_KEYS", env_api_keys),
}


def serve_parser(with_config: bool = True) -> argparse.ArgumentParser:
    """A stand-alone parser with every `wllm serve` argument (and `--config`)."""
    from wllm.entrypoints.serve_cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="wllm serve", add_help=False)
    if with_config:
        parser.add_argument("--config", default=None)
    add_serve_arguments(parser)
    return parser


def _kind(action: argparse.Action) -> tuple[type, Callable[[str], Any] | None]:
    if isinstance(action, argparse.BooleanOptionalAction) or (action.nargs == 0 and isinstance(action.const, bool)):
        return bool, None
    fn = action.type
    if fn is None or fn is str:
        return str, None
    if fn in (int, float):
        return fn, None  # type: ignore[return-value]
    # A checking function such as _positive_int: its return annotation says the value's type.
    kind = typing.get_type_hints(fn).get("return")
    if kind not in (int, float, str):
        raise TypeError(f"serve flag {action.dest}: cannot derive a config type from {fn!r}")
    return kind, fn


def keys() -> dict[str, Key]:
    """The config keys, in the order of `wllm serve --help`, by destination."""
    parser = serve_parser(with_config=False)
    groups = {id(a): g.title or "" for g in parser._action_groups for a in g._group_actions}
    result: dict[str, Key] = {}
    for action in parser._actions:
        if action.dest in (argparse.SUPPRESS, "help") or action.dest in result:
            continue
        kind, check = _kind(action)
        flag = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
        result[action.dest] = Key(
            name=action.dest.replace("_", "-"),
            dest=action.dest,
            kind=kind,
            repeated=isinstance(action, argparse._AppendAction),
            choices=tuple(action.choices) if action.choices else None,
            check=check,
            default=action.default,
            flag=flag,
            group=groups.get(id(action), ""),
        )
    return result


_KIND_NAME = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def _check_item(key: Key, value: Any, where: str) -> Any:
    ok = isinstance(value, key.kind) and not (key.kind is not bool and isinstance(value, bool))
    if key.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        want = _KIND_NAME[key.kind] + (" or a list of them" if key.repeated else "")
        raise ConfigError(f"{where}: key '{key.name}' must be {want}, got {_toml_type(value)} ({value!r})")
    if key.check is not None:
        try:
            value = key.check(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ConfigError(f"{where}: key '{key.name}': {exc}") from None
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where}: key '{key.name}' must be one of {', '.join(map(str, key.choices))}; got {value!r}")
    return value


def load_file(path: str | os.PathLike[str], known: dict[str, Key] | None = None) -> dict[str, Any]:
    """A config file's settings by destination, checked like the flags."""
    known = known if known is not None else keys()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    by_name = {k.name: k for k in known.values()}
    values: dict[str, Any] = {}
    for name, raw in data.items():
        key = by_name.get(name)
        if key is None:
            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{path}: unknown key '{name}'{hint}; the keys are the `wllm serve` flags without "
                f"'--' (see `wllm config show`): {', '.join(by_name)}"
            )
        if key.repeated:
            items = raw if isinstance(raw, list) else [raw]
            value: Any = [_check_item(key, item, str(path)) for item in items]
        else:
            value = _check_item(key, raw, str(path))
        values[key.dest] = _file_path(key, value, path.resolve().parent)
    return values


def _file_path(key: Key, value: Any, folder: Path) -> Any:
    mode = PATH_KEYS.get(key.dest)
    if mode is None or not isinstance(value, str) or Path(value).expanduser().is_absolute():
        return value
    candidate = folder / Path(value).expanduser()
    return str(candidate) if mode == "always" or candidate.exists() else value


@dataclass(frozen=True)
class Setting:
    key: Key
    value: Any
    source: str  # one of SOURCES
    origin: str  # the file, the variable or the flag it came from ("" for a default)


def explicit_flags(argv: list[str]) -> dict[str, Any]:
    """The settings given on the command line (argv: what follows the subcommand), by destination."""
    parser = serve_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    # The real parser has already accepted argv, so this parse cannot fail.
    return {k: v for k, v in vars(parser.parse_known_args(argv)[0]).items() if k != "config"}


def resolve(
    flags: Mapping[str, Any], config: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Setting]:
    """Every setting with its value and source: flag, else file, else environment, else default."""
    known = keys()
    env = os.environ if environ is None else environ
    file_values = load_file(config, known) if config is not None else {}
    result: dict[str, Setting] = {}
    for dest, key in known.items():
        if dest in flags:
            result[dest] = Setting(key, flags[dest], "flag", key.flag)
        elif dest in file_values:
            result[dest] = Setting(key, file_values[dest], "file", str(config))
        elif dest in ENV_SOURCES and (value := ENV_SOURCES[dest][1](env)) is not None:
            result[dest] = Setting(key, value, "env", ENV_SOURCES[dest][0])
        else:
            result[dest] = Setting(key, key.default, "default", "")
    return result


def serve_argv(args: argparse.Namespace, command_words: int) -> list[str] | None:
    """What followed the subcommand's words on the command line (set by wllm.cli.main), if known."""
    argv = getattr(args, "argv", None)
    return None if argv is None else list(argv[command_words:])


def effective(
    args: argparse.Namespace, command_words: int = 1, environ: Mapping[str, str] | None = None
) -> dict[str, Setting]:
    """The settings for parsed `args`: with the command line known, exactly the flags given there win;
    without it (args built in code), every value that differs from its default counts as a flag."""
    argv = serve_argv(args, command_words)
    if argv is not None:
        flags = explicit_flags(argv)
    else:
        flags = {d: getattr(args, d) for d, k in keys().items() if hasattr(args, d) and getattr(args, d) != k.default}
    return resolve(flags, getattr(args, "config", None), environ)


def apply(args: argparse.Namespace, settings: Mapping[str, Setting]) -> argparse.Namespace:
    """A copy of `args` holding the effective values."""
    merged = argparse.Namespace(**vars(args))
    for dest, setting in settings.items():
        setattr(merged, dest, setting.value)
    return merged


def _toml_value(value: Any) -> str:
    import tomli_w

    if isinstance(value, list):  # on one line (tomli_w breaks every array over several)
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def format_settings(settings: Mapping[str, Setting]) -> str:
    """The settings as a TOML config file, each line followed by its source; unset ones commented."""
    lines: list[str] = []
    group = None
    width = 44
    for setting in settings.values():
        key = setting.key
        if key.group != group:
            group = key.group
            title = "MODEL" if group == "positional arguments" else group
            lines.append(f"{'' if not lines else chr(10)}# --- {title} ---")
        source = setting.source + (f" ({setting.origin})" if setting.source in ("file", "env") else "")
        if key.dest in SECRET_KEYS and setting.value:
            text = f"# {key.name} = <{len(setting.value)} key(s), hidden>"
        elif setting.value is None or setting.value == []:
            text = f"# {key.name} = (not set)"
        else:
            text = f"{key.name} = {_toml_value(setting.value)}"
        lines.append(f"{text:<{width}} # {source}")
    return "\n".join(lines) + "\n"
