"""What the code imports is what the installed package declares.

A fresh environment has only what pyproject.toml asks for, so an import that
works here only because someone installed a package by hand is a bug users
hit first. These tests read the *installed* metadata of ``asyncrl``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import pkgutil
import sys

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PACKAGES = ["asyncrl", "buffers", "generators", "learners"]
FIRST_PARTY = {*PACKAGES, "bench", "learning_run", "tests", "conftest", "redis_server"}


def declared() -> dict[str, set[str]]:
    """Declared distribution names -> the extras that declare them ('' for the core)."""
    out: dict[str, set[str]] = {}
    for line in md.requires("asyncrl") or []:
        req = Requirement(line)
        extras = {e for e in ("vllm", "vllm-cpu", "test", "models") if req.marker and req.marker.evaluate({"extra": e})}
        out.setdefault(canonicalize_name(req.name), set()).update(extras or {""})
    return out


def third_party_imports(folder: str) -> dict[str, str]:
    """Top-level module -> one file that imports it (function-local imports included)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def all_modules() -> list[str]:
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        names += [info.name for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}.")]
    return names


@pytest.mark.parametrize("module", all_modules())
def test_every_module_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize(
    "folder, allowed",
    [(package, {"", "vllm", "vllm-cpu", "models"}) for package in PACKAGES]
    + [
        ("tests", {"", "vllm", "vllm-cpu", "test", "models"}),
        ("bench", {"", "vllm", "vllm-cpu", "test", "models", "bench"}),
    ],
)
def test_imports_are_declared(folder, allowed):
    """Every third-party import maps to a distribution declared in the core or an allowed extra."""
    providers = md.packages_distributions()
    decl = declared()
    missing = []
    for module, where in third_party_imports(folder).items():
        dists = {canonicalize_name(d) for d in providers.get(module, [module])}
        if not any(decl.get(d, set()) & allowed for d in dists):
            missing.append(f"{module} (imported in {where}; provided by {sorted(dists)})")
    assert not missing, "imported but not declared in pyproject.toml: " + ", ".join(missing)


def test_indirect_requirements_are_declared():
    """Features that need a package they never import by name: HfDeepSpeedConfig -> accelerate."""
    decl = declared()
    for dist in ("accelerate", "tensorboard"):
        assert "" in decl.get(dist, set()), f"{dist} must be a core dependency"
    from transformers.integrations import HfDeepSpeedConfig

    HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
