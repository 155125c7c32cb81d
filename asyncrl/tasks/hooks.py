"""A config's references to a user's code (``module:callable``), imported as the run's processes import them."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process asyncrl starts with ``python -m``, which would put the working directory
    first on its import path: a user's folder named ``generators/``, ``learners/`` or ``buffers/`` would shadow
    asyncrl's own. It goes last instead; a user's module there is still found (:func:`import_user_module`)."""
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def import_user_module(name: str):
    """Import ``name``, looking in the working directory last when the import path has no such module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name.split(".")[0] or os.getcwd() in sys.path:
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(name)


def resolve(reference: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:callable``; errors name the config field."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: expected 'module:callable', got {reference!r}")
    try:
        target = getattr(import_user_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {reference!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"{field}: {reference!r} is not callable")
    return target


def locate(reference: str, field: str) -> None:
    """``reference`` names a module that exists, and for asyncrl's own modules a callable in it, without
    importing a user's module (which may load a model as it is imported) into the launcher."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr or module_name.split(".")[0] == "asyncrl":
        resolve(reference, field)
        return
    # The run's processes look in the working directory last (import_user_module).
    sys.path.append(os.getcwd())
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        found = False
    finally:
        sys.path.pop()
    if not found:
        raise ValueError(
            f"{field}: cannot import {reference!r}: no module named {module_name!r} in the working "
            "directory or on PYTHONPATH"
        )
