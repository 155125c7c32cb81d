"""The vLLM side of pushed and shared weights: a worker extension that receives and loads a whole version.

vLLM mixes this class into every worker it starts (``worker_extension_cls``),
and the backend drives it with ``collective_rpc``. Each worker is one rank of
the push group: with tensor parallelism, the workers of one engine take
consecutive ranks from ``push_rank`` on. vLLM's loader shards each full
tensor for its worker, as it does when loading from disk. What the worker
offers beyond the extension mechanism goes through :mod:`generators.vllm_compat`.
Shared weights (:mod:`asyncrl.weights.shared`) need no group: each worker
opens the learner's segment once and copies every version out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.weights import folders
from asyncrl.weights.push import WeightGroup
from asyncrl.weights.shared import ViewCache
from asyncrl.wire.protocol import SharedHandle
from generators import vllm_compat


class WeightsInDoubt(RuntimeError):
    """A version failed after some of it reached the model: loading a complete, validated version failed, or
    some of an engine's tensor-parallel workers loaded it and others failed to receive it."""


# What a worker's failure is raised as in the engine's process (any other type: RuntimeError).
_RAISED = {t.__name__: t for t in (TimeoutError, ValueError, FileNotFoundError, ConnectionError)}


def loaded_version(results: list[dict[str, Any]]) -> int:
    """The version every worker loaded, from their answers to ``push_receive`` or ``shared_receive``.

    Where a worker failed, raise as it did (nothing was loaded anywhere), or
    :class:`WeightsInDoubt`. A worker answers its failure rather than raising
    it: vLLM's multiprocess executor raises at the first failed worker and
    leaves the others' answers queued, to be read as the answers of the next call.
    """
    failed = [r for r in results if "error" in r]
    if not failed:
        return results[0]["version"]
    first = failed[0]
    if len(failed) < len(results) or any(r["in_doubt"] for r in failed):
        # not "Superseded: ", which the caller takes for a version overwritten before it was read: harmless
        raise WeightsInDoubt(f"{first['type']} ({first['error'].replace('Superseded: ', '')})")
    raise _RAISED.get(first["type"], RuntimeError)(first["error"])


class WeightPushExtension:
    """Methods added to vLLM's worker; ``self`` is the worker."""

    def push_join(
        self,
        address: str,
        first_rank: int,
        world_size: int,
        timeout_s: float,
        secret: str,
        expected: dict[str, tuple[int, ...]],
        optional: list[str],
    ) -> None:
        """Remember where the group is; it is formed at the first push."""
        device = vllm_compat.worker_device(self)
        self._push_group = WeightGroup(
            address,
            first_rank + vllm_compat.worker_rank(self),
            world_size,
            "nccl" if device.type == "cuda" else "gloo",
            timeout_s,
            device,
            secret,
        )
        self._push_expected = {name: tuple(shape) for name, shape in expected.items()}
        self._push_optional = set(optional)

    def push_receive(self, epoch: int, version: int) -> dict[str, Any]:
        """Receive ``version`` from push ``epoch`` and load it; the answer :func:`loaded_version` reads."""

        def receive() -> tuple[list, int]:
            manifest, tensors = self._push_group.receive(epoch, version)
            return tensors, manifest.version

        return self._load_checked(receive, self._push_expected, self._push_optional)

    def shared_receive(
        self, handle: bytes, version: int, timeout_s: float, expected: dict[str, tuple[int, ...]], optional: list[str]
    ) -> dict[str, Any]:
        """Copy ``version`` out of the learner's segment and load it; the answer :func:`loaded_version` reads."""

        def receive() -> tuple[list, int]:
            if not hasattr(self, "_shared_views"):
                self._shared_views = ViewCache()
            opened = msgspec.msgpack.decode(handle, type=SharedHandle)
            return self._shared_views.view(opened, vllm_compat.worker_device(self)).read(version, timeout_s), version

        return self._load_checked(receive, {name: tuple(shape) for name, shape in expected.items()}, set(optional))

    def _load_checked(
        self, receive: Callable[[], tuple[list, int]], expected: dict[str, tuple[int, ...]], optional: set[str]
    ) -> dict[str, Any]:
        """Receive a whole version, check it against the model, then load it: ``{"version", "bytes"}``, or the
        failure (``in_doubt`` once loading began)."""
        loading = False
        try:
            tensors, version = receive()
            folders.check_shapes(expected, {name: t.shape for name, t in tensors}, version, optional)
            loading = True
            self._push_load(tensors)
        except Exception as error:  # noqa: BLE001  (answered: see loaded_version)
            return {"error": str(error), "type": type(error).__name__, "in_doubt": loading}
        return {"version": version, "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}

    def _push_load(self, tensors: list) -> None:
        """Copy a received version into the live model.

        On GPU, an unquantized model takes the tensors straight into its
        parameters through the model's own ``load_weights`` (which fuses q/k/v
        and gate/up as on a load from disk), skipping the in-place reload's
        per-layer teardown and rebuild. Quantized models, MLA attention (which derives matrices after loading)
        and the CPU build (which repacks weights after loading) go through vLLM's ``reload_weights``.
        """
        import torch

        direct = vllm_compat.worker_device(self).type == "cuda" and not vllm_compat.needs_full_reload(self)
        if not direct:
            vllm_compat.reload_weights_from_tensors(self, tensors)
            return
        with torch.no_grad():
            vllm_compat.load_weights_directly(self, tensors)

    def push_probe(self, epoch: int, num_bytes: int) -> float:
        """Time a raw broadcast of ``num_bytes`` from the learner: the floor a push is measured against."""
        return self._push_group.probe(epoch, num_bytes)
