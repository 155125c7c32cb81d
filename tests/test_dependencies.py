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
# tests/ is on the path of the tests: a test module may import another's helpers (test_vllm_lora's)
TEST_MODULES = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
# scripts/ holds tools a bench may put on its path (scripts/hosts.py: hosts on one machine)
SCRIPTS = {path.stem for path in (ROOT / "scripts").glob("*.py")}
FIRST_PARTY = {*PACKAGES, "bench", "learning_run", "tests", "conftest", "redis_server", *TEST_MODULES, *SCRIPTS}


def declared() -> dict[str, set[str]]:
    """Declared distribution names -> the extras that declare them ('' for the core).

    Every extra the package provides is tried on each requirement's marker, so a requirement of an extra is
    never mistaken for a core one (which would let any code import it).
    """
    extras = md.metadata("asyncrl").get_all("Provides-Extra") or []
    out: dict[str, set[str]] = {}
    for line in md.requires("asyncrl") or []:
        req = Requirement(line)
        if req.marker is None:
            names = {""}
        else:
            names = {e for e in extras if req.marker.evaluate({"extra": e})}
            assert names, f"{line}: its marker names no extra asyncrl provides ({', '.join(extras)})"
        out.setdefault(canonicalize_name(req.name), set()).update(names)
    return out


def third_party_imports(folder: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Top-level module -> one file that imports it (function-local imports included), leaving out ``skip``
    (sub-folders checked on their own)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        if any(path.is_relative_to(ROOT / s) for s in skip):
            continue
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


KERNEL = {"", "vllm", "vllm-cpu", "models"}  # what a run imports: the core and the features of its config
# Each folder and the extras its code may import; a sub-folder listed here is checked on its own.
ALLOWED = {
    **dict.fromkeys(PACKAGES, KERNEL),
    "asyncrl/launch/ray": KERNEL | {"ray"},
    "tests": KERNEL | {"test", "ray"},
    "bench": KERNEL | {"test", "ray", "bench"},
}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_are_declared(folder):
    """Every third-party import maps to a distribution declared in the core or an extra the folder may use."""
    providers = md.packages_distributions()
    decl = declared()
    skip = tuple(other for other in ALLOWED if other != folder and other.startswith(folder + "/"))
    missing = []
    for module, where in third_party_imports(folder, skip).items():
        dists = {canonicalize_name(d) for d in providers.get(module, [module])}
        if not any(decl.get(d, set()) & ALLOWED[folder] for d in dists):
            missing.append(f"{module} (imported in {where}; provided by {sorted(dists)})")
    assert not missing, "imported but not declared in pyproject.toml: " + ", ".join(missing)


def test_an_extra_is_not_the_core():
    """ray and trl come with their extras only (trl with the tests' too, which check the loss against TRL's):
    the kernel may not import them."""
    decl = declared()
    assert decl["ray"] == {"ray"} and decl["trl"] == {"bench", "test"} and decl["pytest"] == {"test"}
    assert not decl["ray"] & ALLOWED["asyncrl"], "an import of ray in the kernel would pass as declared"


def test_indirect_requirements_are_declared():
    """Features that need a package they never import by name: HfDeepSpeedConfig -> accelerate."""
    decl = declared()
    for dist in ("accelerate", "tensorboard"):
        assert "" in decl.get(dist, set()), f"{dist} must be a core dependency"
    from transformers.integrations import HfDeepSpeedConfig

    HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
