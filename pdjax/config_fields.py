"""One setting of ``pdjax.config``: how it is declared, how its value is checked and how it
becomes a command-line flag (DESIGN.md §1).

A settings group (``ModelArgs``, ``CacheArgs``, ...) is a frozen dataclass whose fields are
made by ``setting`` (default, ``--help`` text, allowed values, declared once); its
``__post_init__`` calls ``check_fields`` (declared type, choices) and the range checks below,
each raising ``ValueError("FIELD: message")``, the field's name first. ``add_flag`` makes a field's ``--flag``;
``FlagParser`` prints every parse error as one line ``error: FIELD: message``. Pure Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
import re
import sys


def setting(default, help: str = "", choices=None):
    """A settings field: its default, its ``--help`` text and its allowed values, a tuple or a
    function returning one (a registry that tests extend); checked on construction, ``None``
    always allowed for a field whose default is None."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def setting_choices(f: dataclasses.Field) -> tuple | None:
    """The allowed values of settings field ``f`` (None: any value of its type)."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


# A setting's declared type -> what its value may be. Integers also fit a C long (each field's
# own check bounds it further): a larger one would overflow in numpy or the OS.
_SETTING_TYPES = {"int": ((numbers.Integral,), "an integer"),
                  "float": ((numbers.Real,), "a number"),
                  "str": ((str,), "a string"), "bool": ((bool,), "true or false")}
_INT_SETTING_MAX = (1 << 63) - 1


def _check_type(obj, f: dataclasses.Field) -> None:
    """``ValueError`` naming the field for a value of another type than the field's
    (``Engine(context_length="128")`` was a ``TypeError`` from a comparison, ``"yes"`` for a
    bool was taken as true) or an integer past ``_INT_SETTING_MAX``; a path object in a
    string field is taken as its string."""
    annotation = str(f.type)
    optional = annotation.endswith(" | None")
    kind = _SETTING_TYPES.get(annotation.removesuffix(" | None"))
    v = getattr(obj, f.name)
    if kind is None or (v is None and optional):
        return
    types, what = kind
    if str in types and isinstance(v, os.PathLike):
        object.__setattr__(obj, f.name, os.fspath(v))
        return
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        if optional:      # "true, false or null", "an integer or null"
            what = what.replace(" or ", ", ") + " or null"
        raise ValueError(f"{f.name}: must be {what}, got {type(v).__name__} {v!r:.60}")
    if types == (numbers.Integral,):
        if abs(v) > _INT_SETTING_MAX:
            raise ValueError(f"{f.name}: must be at most {_INT_SETTING_MAX} in magnitude, got "
                             f"{v}")
        object.__setattr__(obj, f.name, int(v))       # a numpy integer becomes an int


def check_fields(obj) -> None:
    """Every field of the settings dataclass ``obj`` holds a value of its declared type
    (a numpy integer becomes an int, a path a string), and every field with ``choices`` one
    of them; ``ValueError`` naming the field otherwise."""
    for f in dataclasses.fields(obj):
        _check_type(obj, f)
        v = getattr(obj, f.name)
        choices = setting_choices(f)
        if choices is not None and v not in choices and not (v is None and f.default is None):
            raise ValueError(f"{f.name}: must be one of {', '.join(choices)}; got {v!r}")


def check_int(obj, name: str, low: int, high: int | None = None,
              allow_none: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``obj.<name>`` is an integer in ``[low, high]``
    (``high`` None: no upper bound; None allowed with ``allow_none``)."""
    v = getattr(obj, name)
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(
            low, f"an integer >= {low}")
        raise ValueError(f"{name}: must be {what}, got {v!r}")
    if high is not None and v > high:
        raise ValueError(f"{name}: must be in [{low}, {high}], got {v}")


def check_positive(obj, *names: str) -> None:
    """``ValueError`` naming the first of ``names`` whose value on ``obj`` is not a number
    > 0."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}: must be > 0, got {v!r}")


def add_flag(group, f: dataclasses.Field) -> None:
    """Add settings field ``f`` to the argparse (group) ``group`` as ``--f-name`` (SGLang's
    spelling): a bool is a switch, an optional bool ``--flag`` / ``--no-flag`` (unset:
    auto), any other its type with its choices and its default in the help."""
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata["help"]
    if f.type in ("bool", bool):
        group.add_argument(flag, action="store_true", default=f.default, help=help_text)
        return
    if str(f.type) == "bool | None":   # auto unless --flag / --no-flag
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_text)
        return
    typ = {"int": int, "float": float, "int | None": int, "float | None": float}.get(
        str(f.type), str)
    group.add_argument(flag, type=typ, default=f.default, choices=setting_choices(f),
                       help=f"{help_text} (default: {f.default})".strip())


class FlagParser(argparse.ArgumentParser):
    """``argparse`` whose every error, its own included, is one line on stderr and exit 2:
    ``error: FIELD: message`` (``argument --page-size: invalid int value: 'x'`` becomes
    ``error: page_size: invalid int value: 'x'``), without the usage block (``--help`` prints
    it). An unknown flag is reported before a missing required one (argparse checks the
    required ones first: ``python -m pdjax.router --bogus`` named ``--prefill, --decode``
    and not ``--bogus``)."""

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        required = [a for a in self._actions if a.required]
        for a in required:
            a.required = False
        try:      # a first pass only for the unknown flags (its namespace is thrown away)
            _, unknown = self.parse_known_args(args, argparse.Namespace(**vars(namespace))
                                               if namespace is not None else None)
        finally:
            for a in required:
                a.required = True
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)

    def error(self, message: str):
        m = re.match(r"argument --([\w-]+)(?:/--[\w-]+)?: (.*)", message, re.S)
        if m:
            message = f"{m.group(1).replace('-', '_')}: {m.group(2)}"
        self.exit(2, f"error: {' '.join(message.split())}\n")
