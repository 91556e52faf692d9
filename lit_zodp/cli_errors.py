"""One-line parse errors for the ``lightning`` / ``lit-zodp`` command.

jsonargparse reports a misspelled option (on the command line or in a config file) or a value of the
wrong type as a nested message under a ~60-line usage dump. :class:`OneLineErrorParser` prints one
line naming the full option, jsonargparse's core reason and the closest valid name, and exits with 2,
like every other configuration error of the CLI (:func:`lit_zodp.cli.cli_main`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser


class OneLineErrorParser(LightningArgumentParser):
    """A parse error (a misspelled option on the command line or in a config file, a value of the wrong
    type) ends in one line naming the option, with the closest valid name where there is one, and exit
    code 2, instead of jsonargparse's usage dump. ``--help`` and ``--print_config`` are unchanged; the
    parsers jsonargparse builds internally with ``exit_on_error=False`` still raise."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step 10` was taken as max_steps, silently
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        self._logger.error(message)
        line = parse_error_line(message, self)
        if line.endswith("expected one argument"):  # `--model.init_args.lam -1e-3`: argparse reads -1e-3 as an option
            line += " (a value starting with '-' is written with '=': `--model.init_args.lam=-1e-3`)"
        sys.stderr.write(f"lit-zodp: error: {line}\n")
        self.exit(2)


_NOISE = re.compile(r"Does not validate against any of the Union subtypes|Subtypes: |Errors:|Given value"
                    r"|Expected a <class 'NoneType'>|Expected a path but .* either not accessible or invalid")
_KEY = re.compile(r'Parser key "([^"]+)":?\s*(.*)$')
_CLASS = re.compile(r"Problem with given class_path '([^']+)':?$")


def parse_error_line(message: str, parser=None) -> str:
    """jsonargparse's (multi-line, nested) parse error as one line: the full option name, the core reason,
    and a close valid option name when there is one. E.g. ``--model.init_args.clipp 1.0`` gives
    "`model.init_args.clipp`: Option 'clipp' is not accepted by lit_zodp.algorithms.DPZero (did you
    mean `model.init_args.clip`?)"."""
    keys, class_path, reasons = [], None, []
    for line in (raw.strip().removeprefix("- ").strip() for raw in message.splitlines()):
        if not line or _NOISE.match(line):
            continue
        key = _KEY.match(line)
        if key:
            keys += ["init_args", key[1]] if class_path else [key[1]]
            class_path, line = None, key[2]
        elif _CLASS.match(line):
            class_path, line = _CLASS.match(line)[1], ""
        if line:
            reasons.append(_type_names(line))
    if not reasons:
        return " ".join(message.split())
    reason = "; ".join(reasons) + _yaml_float_hint(reasons, message)
    rejected = re.match(r"Option '([^']+)' is not accepted", reason)
    if rejected and class_path:
        option = ".".join(keys + ["init_args", rejected[1]])
        hint = _closest(rejected[1], _init_arguments(class_path))
        hint = hint and ".".join(keys + ["init_args", hint])
        return f"`{option}`: {reason} by {class_path}{_did_you_mean(hint)}"
    where = f"`{'.'.join(keys)}`: " if keys else ""
    where += f"class_path '{class_path}': " if class_path else ""
    return f"{where}{reason}{_did_you_mean(_hint(reason, parser))}"


def _type_names(text: str) -> str:
    """``Expected a <class 'int'>`` as ``Expected an int``."""
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    return re.sub(r"\bExpected a (?=[aeiou])", "Expected an ", text)


_NON_FINITE = re.compile(r"(?:Got|Given) value: (-?)(inf|infinity|nan)$", re.IGNORECASE | re.MULTILINE)


def _yaml_float_hint(reasons: list[str], message: str) -> str:
    """``inf`` is a string to YAML, which reads the command line and configs: a float option given ``inf``,
    ``-inf`` or ``nan`` is told the spelling YAML reads as a float (``.inf``, ``-.inf``, ``.nan``)."""
    word = _NON_FINITE.search(message)
    if word is None or not any(reason.startswith("Expected a float") for reason in reasons):
        return ""
    spelling = ".nan" if word[2].lower() == "nan" else f"{word[1]}.inf"
    return f": write `{spelling}` (the command line and configs are YAML, where `{word[1]}{word[2]}` is a string)"


def _did_you_mean(hint: Optional[str]) -> str:
    return f" (did you mean `{hint}`?)" if hint else ""


def _closest(name: str, candidates) -> Optional[str]:
    matches = difflib.get_close_matches(name, list(candidates), n=1)
    return matches[0] if matches else None


def _hint(reason: str, parser) -> Optional[str]:
    """A close valid name for an unknown option (command line or config file) or a missing class."""
    missing = re.match(r"module '([\w.]+)' has no attribute '(\w+)'", reason)
    if missing:
        hint = _closest(missing[2], dir(imported(missing[1])))
        return hint and f"{missing[1]}.{hint}"
    unknown = re.search(r"unrecognized arguments: (--\S+)|does not accept option '([^']+)'", reason)
    if unknown is None or parser is None:
        return None
    if unknown[1]:
        return _closest(unknown[1], _option_strings(parser))
    hint = _closest("--" + unknown[2], _option_strings(parser))
    return hint and hint[2:]


def _option_strings(parser) -> list[str]:
    """Every ``--option`` of ``parser`` and of its subcommands' parsers."""
    names = []
    for action in parser._actions:
        names += [name for name in action.option_strings if name.startswith("--")]
        for subparser in (getattr(action, "_name_parser_map", None) or {}).values():
            names += _option_strings(subparser)
    return names


def _init_arguments(class_path: str) -> list[str]:
    """The named ``__init__`` arguments of ``class_path`` and of the bases its ``**kwargs`` reach (for a
    suggestion; none if it cannot be imported)."""
    names = []
    for klass in getattr(imported(class_path), "__mro__", ()):
        try:
            parameters = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            break
        names += [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if all(p.kind != p.VAR_KEYWORD for p in parameters):
            break
    return [name for name in dict.fromkeys(names) if name != "self"]


def imported(dotted: str):
    """The module or the module attribute ``dotted`` names; ``None`` if it cannot be imported."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except (ImportError, ValueError):
        return None


__all__ = ["OneLineErrorParser", "imported", "parse_error_line"]
