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

from typing import Any

import msgspec

from asyncrl.weights import folders
from asyncrl.weights.push import WeightGroup
from asyncrl.weights.shared import ViewCache
from asyncrl.wire.protocol import SharedHandle
from generators import vllm_compat


class PushLoadError(RuntimeError):
    """The engine failed while loading a complete, validated push: its weights are in doubt."""


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
        """Receive ``version`` from push ``epoch`` and load it; on any error nothing is loaded."""
        manifest, tensors = self._push_group.receive(epoch, version)
        return self._load_checked(tensors, manifest.version, self._push_expected, self._push_optional)

    def shared_receive(
        self, handle: bytes, version: int, timeout_s: float, expected: dict[str, tuple[int, ...]], optional: list[str]
    ) -> dict[str, Any]:
        """Copy ``version`` out of the learner's segment and load it; on any error nothing is loaded."""
        if not hasattr(self, "_shared_views"):
            self._shared_views = ViewCache()
        opened = msgspec.msgpack.decode(handle, type=SharedHandle)
        view = self._shared_views.view(opened, vllm_compat.worker_device(self))
        tensors = view.read(version, timeout_s)
        return self._load_checked(
            tensors, version, {name: tuple(shape) for name, shape in expected.items()}, set(optional)
        )

    def _load_checked(
        self, tensors: list, version: int, expected: dict[str, tuple[int, ...]], optional: set[str]
    ) -> dict[str, Any]:
        """Check a whole received version against the model, then load it; a failure past the check is a
        :class:`PushLoadError` (the engine's weights are in doubt)."""
        folders.check_shapes(expected, {name: t.shape for name, t in tensors}, version, optional)
        try:
            self._push_load(tensors)
        except Exception as error:
            raise PushLoadError(f"PushLoadError: v{version}: {error}") from error
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
