"""The config keys as ``--help`` text, generated from the Struct types and their fields' comments."""

from __future__ import annotations

import functools
import inspect
import io
import itertools
import json
import sys
import tokenize
import types
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import yaml

from asyncrl.config.run import RunConfig


def describe_keys(sections: Sequence[str] | None = None) -> str:
    """Every config key as ``dotted.name  type = default  comment``, grouped by section.

    Generated from the Struct types (:mod:`asyncrl.config.sections`,
    :mod:`~asyncrl.config.learning`, :mod:`~asyncrl.config.deployment` and
    :mod:`asyncrl.config.run`), so a new field shows up in every CLI's
    ``--help`` without anyone writing it twice; comments are the field's ``#``
    comments in the module that defines its class. ``sections`` picks fields
    of :class:`RunConfig` by name (``"learner"``, ``"run_dir"``); None: all.
    """
    top = {f.name: f for f in msgspec.structs.fields(RunConfig)}
    chosen = list(top) if sections is None else list(sections)
    unknown = [name for name in chosen if name not in top]
    if unknown:
        raise ValueError(f"not fields of RunConfig: {unknown}")
    groups: list[tuple[str, list[tuple[str, str, str]]]] = []
    scalars = [top[n] for n in chosen if not _is_struct(top[n].type)]
    if scalars:
        groups.append(("top level", _rows(RunConfig, scalars, "")))
    for name in chosen:
        cls = top[name].type
        if _is_struct(cls):
            doc = (cls.__doc__ or "").strip()
            heading = f"{name}: {doc.splitlines()[0]}" if doc else name
            groups.append((heading, _rows(cls, msgspec.structs.fields(cls), f"{name}.")))
    rows = [row for _, group in groups for row in group if row[1]]
    key_w = max((len(key) for key, _, _ in rows), default=0)
    spec_w = min(max((len(spec) for _, spec, _ in rows), default=0), 30)  # a longer default pushes only its own comment
    lines = [
        "config keys: --KEY VALUE or KEY=VALUE, VALUE as YAML "
        "(from asyncrl/config/sections.py, learning.py, deployment.py and run.py)"
    ]
    for heading, group in groups:
        lines += ["", heading]
        for key, spec, comment in group:
            if not spec:  # a comment over a group of fields
                lines.append(f"  # {comment}")
            else:
                lines.append(f"  {key:<{key_w}}  {spec:<{spec_w}}  {comment}".rstrip())
    return "\n".join(lines)


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _rows(cls: type, fields: Iterable[Any], prefix: str) -> list[tuple[str, str, str]]:
    """``(key, "type = default", comment)`` per leaf field; ``spec`` is empty for a group comment line."""
    comments = _field_comments(cls)
    rows: list[tuple[str, str, str]] = []
    for f in fields:
        above, trailing = comments.get(f.name, ("", ""))
        if _is_struct(f.type):  # a nested section
            rows += _rows(f.type, msgspec.structs.fields(f.type), f"{prefix}{f.name}.")
            continue
        if above and trailing:
            rows.append(("", "", above))
        rows.append((prefix + f.name, f"{_type_name(f.type)} = {_default(f)}", trailing or above))
    return rows


def _type_name(tp: Any) -> str:
    """``float``, ``str | None``, ``zmq|inproc|redis`` (a Literal), ``dict[str, Any]``."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _default(f: Any) -> str:
    """The default as it would be written in YAML or on the command line."""
    if f.default is not msgspec.NODEFAULT:
        value = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, str) and value and yaml.safe_load(value) == value:
        return value
    if isinstance(value, float) and "e" in repr(value) and "." not in repr(value):
        mantissa, exponent = repr(value).split("e")
        return f"{mantissa}.0e{exponent}"  # YAML 1.1 reads 1e-05 as a string, 1.0e-05 as a float
    return json.dumps(msgspec.to_builtins(value))


def _field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (comment lines above it, comment after it)}`` read from the class's source."""
    return _module_comments(cls.__module__).get(cls.__qualname__, {})


@functools.cache
def _module_comments(module: str) -> dict[str, dict[str, tuple[str, str]]]:
    """Field comments of every top-level class of ``module``, from one pass of ``tokenize``.

    One pass over the module, because ``inspect.getsource(cls)`` parses the
    whole module again for every class (~30 ms each). Empty when the source
    is not available: the help then lists no comments.
    """
    try:
        source = inspect.getsource(sys.modules[module])
    except (KeyError, OSError, TypeError):
        return {}
    found: dict[str, dict[str, tuple[str, str]]] = {}
    fields: dict[str, tuple[str, str]] = {}
    depth, field, pending, line_start = 0, None, [], True
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok, nxt in itertools.pairwise(tokens):
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line[: tok.start[1]].strip() and field is not None:
                above, trailing = fields[field]
                fields[field] = (above, f"{trailing} {text}".strip())
            else:
                pending.append(text)
        elif tok.type == tokenize.NL and not tok.line.strip():
            pending = []  # a blank line ends a comment block
        elif tok.type == tokenize.NEWLINE:
            field, pending = None, []
        elif line_start and depth == 0 and tok.string == "class" and nxt.type == tokenize.NAME:
            fields = found.setdefault(nxt.string, {})
        elif line_start and depth == 1 and tok.type == tokenize.NAME and nxt.string == ":":
            field = tok.string
            fields[field] = (" ".join(pending), "")
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            line_start = tok.type == tokenize.NEWLINE
    return found
