"""Flags and ``--config`` files → the command's dataclasses, and back to a config file.

``HfArgumentParser`` builds the flags from the dataclasses of a command
(`dattri_llm.cli.arguments.COMMANDS`). A ``--config`` file (YAML or JSON, e.g. a
run's ``config.yaml``) supplies values first; flags given beside it override
them. :func:`resolved_config` writes every recorded field back as plain data.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from dattri_llm.cli.arguments import COMMANDS, RunArguments
from dattri_llm.cli.errors import CLIError

__all__ = ["build_parser", "parse", "read_config_file", "resolved_config"]


class _Parser(HfArgumentParser):
    """An ``HfArgumentParser`` whose errors raise `CLIError` (one line, no usage dump)."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's hook
        raise CLIError(message, code=2)


def build_parser(command: str) -> HfArgumentParser:
    """The parser of one command: `RunArguments` plus the command's dataclasses."""
    description, classes = COMMANDS[command]
    return _Parser((RunArguments, *classes), prog=f"dattri-llm {command}", description=description)


def read_config_file(path: str) -> dict[str, Any]:
    """A config file's mapping of option → value (``CLIError`` when unreadable)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"--config file {file} not found")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise CLIError(f"--config file {file} is not valid YAML/JSON: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CLIError(f"--config file {file} must hold a mapping of option: value")
    return data


def _config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``None`` when absent)."""
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise CLIError("argument --config: expected one argument", code=2)
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse(command: str, argv: list[str]) -> tuple[Any, ...]:
    """``(RunArguments, *command dataclasses)`` from ``argv`` and its ``--config`` file.

    Raises:
        CLIError: a bad flag, an unknown key in the config file, a config file
            written by another command, or a value a dataclass refuses.
    """
    parser = build_parser(command)
    path = _config_path(argv)
    if path is not None:
        values = read_config_file(path)
        recorded = values.pop("command", command)
        if recorded != command:
            raise CLIError(f"--config {path} was written by `{recorded}`, not `{command}`")
        known = {action.dest for action in parser._actions} - {"help", "config"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise CLIError(f"--config {path}: unknown option(s) {unknown} for `{command}`")
        for action in parser._actions:
            if action.dest in values:
                action.required = False
        parser.set_defaults(**values)
    try:
        return parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    except (ValueError, TypeError) as err:
        raise CLIError(str(err), code=2) from err


def resolved_config(command: str, parsed: tuple[Any, ...]) -> dict[str, Any]:
    """Every field of the command's dataclasses (not `RunArguments`) as plain YAML data."""
    config: dict[str, Any] = {"command": command}
    for instance in parsed:
        if isinstance(instance, RunArguments):
            continue
        for f in dataclasses.fields(instance):
            config[f.name] = _plain(getattr(instance, f.name))
    return config


def _plain(value: Any) -> Any:
    """``value`` as YAML-safe data (tuples → lists; anything exotic → its string)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
