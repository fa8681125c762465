"""Recipe files (``--config FILE.toml``): TOML keys -> flag values, checked against the parser.

A recipe file is flat TOML. Its keys are the flags' long names without the dashes
(``lr-warmup-epochs = 5``; config.json's spelling ``lr_warmup_epochs`` is accepted too) and
``data`` for the DIR argument. A value has its flag's type: true/false for a switch, a number, a
string, a list for a flag that takes several values (a comma-separated flag such as --log-to
takes a list or one string). The values become the parser's defaults, so every flag given on
the command line wins over the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from imagenet.errors import UsageError

# The TOML types each flag type accepts (an integer is a fine float).
ACCEPTS: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), None: (str,)}
# Parser entries a file cannot set, and why.
NOT_IN_FILES = {"help": "it prints the help",
                "config": "a recipe file cannot name another one",
                "local_rank": "the launcher sets it for each process"}


def read_toml(path: Path) -> dict[str, Any]:
    """The file's table, or one UsageError naming the file and what is wrong with it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser is on PyPI as tomli
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise UsageError(f"--config {path}: reading TOML needs Python 3.11 or newer "
                             "(tomllib); on Python 3.10: pip install tomli") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path} is not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path} is not valid TOML: {exc}") from None


def flag_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a file may use -> its parser action: long names, aliases, config.json names."""
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in NOT_IN_FILES:
            continue
        negatives = getattr(action, "negatives", ())  # --no-NAME: a file says NAME = false
        names = [o[2:] for o in action.option_strings
                 if o.startswith("--") and o not in negatives] or [action.dest]
        for name in (*names, action.dest):
            keys[name] = action
    return keys


def file_values(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The file's settings as ``{dest: value}``, each checked like its flag on the command line."""
    keys = flag_keys(parser)
    values: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in read_toml(path).items():
        action = keys.get(key)
        if action is None:
            raise UsageError(f"--config {path}: unknown key '{key}'{_closest(key, keys, parser)}")
        if action.dest in seen:
            raise UsageError(f"--config {path}: '{seen[action.dest]}' and '{key}' both set "
                             f"{_flag(action)}; keep one")
        seen[action.dest] = key
        values[action.dest] = _checked(action, value, f"--config {path}: '{key}'")
    return values


def _closest(key: str, keys: dict[str, argparse.Action], parser: argparse.ArgumentParser) -> str:
    """'; did you mean ...' for an unknown key (or where its flags are listed)."""
    if key in NOT_IN_FILES:
        return f" ({NOT_IN_FILES[key]})"
    dashed = sorted({k for k in keys if "_" not in k})
    close = difflib.get_close_matches(key.replace("_", "-"), dashed, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}' ({_flag(keys[close[0]])})?"
    return f" (keys are the long flag names of {parser.prog} --help, without the dashes)"


def _flag(action: argparse.Action) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else action.dest.upper()


def _checked(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` in the type the parser would have made of the flag's text."""
    if action.nargs == 0:  # a switch (flags.Switch)
        if not isinstance(value, bool):
            raise _bad(where, action, value, "true or false")
        return value
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise _bad(where, action, value, "a list, e.g. [30, 60]")
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise _bad(where, action, value, f"a list of {action.nargs} values")
        if action.nargs == "+" and not value:
            raise _bad(where, action, value, "a list of at least one value")
        return [_scalar(action, v, where) for v in value]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    """One value of the flag's type, within its choices."""
    kind = action.type
    if kind in ACCEPTS:
        if isinstance(value, bool) or not isinstance(value, ACCEPTS[kind]):
            raise _bad(where, action, value, _expected(kind))
        value = float(value) if kind is float else value
    else:  # a parsing function: give it the flag's text
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _bad(where, action, value, "a string")
        try:
            value = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise UsageError(f"{where} ({_flag(action)}): {exc}") from None
    if action.choices is not None and value not in action.choices:
        options = ", ".join(_toml(c) for c in action.choices)
        raise UsageError(f"{where} must be one of {options} (as {_flag(action)}), got "
                         f"{_toml(value)}")
    return value


def _expected(kind: Any) -> str:
    return {int: "an integer", float: "a number"}.get(kind, "a string")


def _bad(where: str, action: argparse.Action, value: Any, expected: str) -> UsageError:
    got = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
           list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
    return UsageError(f"{where} must be {expected} (the value of {_flag(action)}), got "
                      f"{_toml(value)} ({got})")


def _toml(value: Any) -> str:
    """A value as the file spells it: true, "0.1", [30, 60]."""
    return json.dumps(value, default=str)


def record(path: str | None, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """For config.json: the recipe file and what it set (the merged flags are beside it);
    ``parser``: main.py's."""
    if path is None:
        return {}
    try:
        values = file_values(parser, Path(path))
    except UsageError as exc:  # changed or removed since the flags were parsed
        return {"config_file": {"path": str(Path(path).resolve()), "unreadable": str(exc)}}
    return {"config_file": {"path": str(Path(path).resolve()), "values": values}}
