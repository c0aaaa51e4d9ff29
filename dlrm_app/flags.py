"""Command-line flags generated from the typed configs: one dataclass field is one flag.

A field's type decides the flag's parsing, its default is shown in ``--help``, and the help line
is the field's docstring (the string literal under it in the class body)::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TrainConfig:
        epochs: int = 3
        \"\"\"Passes over the train split.\"\"\"        ->   --epochs EPOCHS  Passes over the
                                                              train split. (default: 3)

A field's ``metadata`` may say more (``dlrm_app.config.positional`` / ``required``): ``"cli":
"positional"`` makes it a positional argument (``"nargs"`` for several), ``"cli": "required"`` a
flag that must be given, ``"metavar"`` its placeholder, ``"type"`` a parser of its own. ``Literal[...]`` types become choices; a
bool defaulting to False is a plain switch (``--quiet``), one defaulting to True or None gets
its ``--no-`` twin.

Flags default to ``argparse.SUPPRESS``: the namespace holds only the flags the user gave, so a
caller can tell "left at its default" from "given" (``--resume`` needs that to check a flag
against the run's saved config). ``config_values`` turns the namespace back into field values,
``config_from_values`` into the config itself (nested sections included).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import sys
import textwrap
import types
import typing
from typing import Any

BOOLEAN_FLAGS = {"pipelined": "pipeline"}
"""Boolean fields whose flag pair reads better under another stem (``--no-pipeline``)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the attribute docstrings in ``cls``'s source."""
    docs = _module_docs(cls.__module__).get(cls.__qualname__)
    if docs is None:  # a class defined in a function: its own source
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        node = tree.body[0]
        assert isinstance(node, ast.ClassDef), "getsource of a class is its class statement"
        docs = _attribute_docs(node.body)
    return docs


@functools.cache
def _module_docs(module: str) -> dict[str, dict[str, str]]:
    """``{class qualname: field docs}`` of every class in a module, from one parse of its
    source (``inspect.getsource(cls)`` parses the whole module again for each class: 0.2 s of
    every command's start for the 13 configs)."""
    docs: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                docs[prefix + node.name] = _attribute_docs(node.body)
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(inspect.getsource(sys.modules[module])).body, "")
    return docs


def _attribute_docs(body: list[ast.stmt]) -> dict[str, str]:
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.replace("``", "").split())
    return docs


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every optional flag's default; not for required ones (they have none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.replace(",", "-").split("-") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of layer sizes like "
                                         "512-256-128") from None
    if not sizes:
        raise argparse.ArgumentTypeError("empty layer size list")
    return sizes


def _optional(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _argument_type(parse: Any) -> Any:
    """A field's own parser for argparse: its ValueError becomes argparse's one-line error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = "value"
    return convert


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return "-".join(str(v) for v in value)
    return str(value)


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *,
                     exclude: tuple[str, ...] = ()) -> None:
    """One argument per field of ``cls`` (nested config dataclasses are flattened)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section class
            add_config_flags(parser, hint, exclude=exclude)
            continue
        default = field.default
        help_text = docs.get(field.name, "")
        cli = field.metadata.get("cli")
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        if "metavar" in field.metadata:
            kwargs["metavar"] = field.metadata["metavar"]
        args = typing.get_args(hint)
        optional = type(None) in args and (typing.get_origin(hint) in (typing.Union, types.UnionType))
        base = next(a for a in args if a is not type(None)) if optional else hint
        if cli == "positional":
            parser.add_argument(field.name, nargs=field.metadata.get("nargs"), **kwargs)
            continue
        kwargs["dest"] = field.name
        flag = "--" + field.name.replace("_", "-")
        if cli == "required":
            parser.add_argument(flag, required=True, **kwargs)
            continue
        if default is not dataclasses.MISSING and "(default:" not in help_text:
            kwargs["help"] = f"{help_text} (default: {_show(default)})"
        if base is bool:
            if default is False:
                parser.add_argument(flag, action="store_true", **kwargs)
                continue
            if optional and default is None:  # a tri-state: None decides at run time
                kwargs["help"] = f"{help_text} (default: auto)"
            stem = "--" + BOOLEAN_FLAGS.get(field.name, field.name).replace("_", "-")
            parser.add_argument(stem, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if "type" in field.metadata:  # a parser of the field's own (``--save-every 10m``)
            kwargs["type"] = _argument_type(field.metadata["type"])
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            kwargs["choices"] = [m.value for m in base]
            kwargs["type"] = str
        elif typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
            kwargs["type"] = str
        elif typing.get_origin(base) is tuple:
            kwargs["type"] = _sizes
            kwargs["metavar"] = "A-B-C"
        else:
            kwargs["type"] = _optional(base) if optional else base
            if base in SHORT_METAVARS:
                kwargs.setdefault("metavar", SHORT_METAVARS[base])
        parser.add_argument(flag, **kwargs)


SHORT_METAVARS = {int: "N", float: "X"}
"""Placeholders of number flags (``--batch-size N``): argparse's default, the name in capitals,
pushed most help lines of ``train`` onto a line of their own."""


def short_usage(parser: argparse.ArgumentParser) -> str:
    """``PROG`` with its positional and required arguments and ``[options]``: the usage line of
    a command with many flags (the whole list took 32 lines of ``train --help``)."""
    words = []
    for action in parser._actions:
        if not action.option_strings:
            name = action.metavar or action.dest
            words.append(f"{name} [{name} ...]" if action.nargs == "+" else str(name))
        elif action.required:
            words.append(f"{action.option_strings[0]} {action.metavar or action.dest.upper()}")
    return " ".join(["%(prog)s", *words, "[options]"])


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` the user gave on the command line, converted to the field types
    (enums from their values); nested configs come back as nested dicts."""
    given = vars(args)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section class
            nested = config_values(args, hint)
            if nested:
                values[field.name] = nested
        elif field.name in given:
            value = given[field.name]
            if isinstance(hint, type) and issubclass(hint, enum.Enum):
                value = hint(value)
            values[field.name] = value
    return values


def config_from_values(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` built from ``config_values``' output: nested sections built the same way, the
    fields (and sections) not given left at their defaults."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section class
            value = config_from_values(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)
