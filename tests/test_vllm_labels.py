"""Per-token weight versions from an engine that schedules the next batch while the last one runs."""

from generators import vllm_backend, vllm_compat
from generators.vllm_backend import VllmBackend


def backend_over(async_scheduling: bool) -> VllmBackend:
    """A backend whose engine labels tokens (vLLM >= 0.30), with the engine's calls logged."""
    backend = object.__new__(VllmBackend)
    backend.llm = object()
    backend._engine_stamps, backend._async_scheduling, backend._label_after_step = True, async_scheduling, None
    return backend


def test_under_async_scheduling_the_batch_in_flight_keeps_the_old_label(monkeypatch):
    """A step launches the next batch and returns the one before, which the engine labels as it collects it: a
    label set between two steps would stamp the new version on a batch the old weights computed."""
    log = []
    monkeypatch.setattr(vllm_compat, "step", lambda llm: log.append("step") or [])
    monkeypatch.setattr(vllm_compat, "set_weight_version", lambda llm, v: log.append(f"label {v}"))
    assert vllm_backend.vllm_compat is vllm_compat
    backend = backend_over(async_scheduling=True)
    backend.step()
    backend.relabel(5)  # new weights loaded between two steps
    assert log == ["step"]
    backend.step()  # collects the batch launched before the load, then labels what follows
    backend.step()
    assert log == ["step", "step", "label 5", "step"]
    log.clear()
    backend = backend_over(async_scheduling=False)  # a step computes and returns its own batch
    backend.relabel(6)
    backend.step()
    assert log == ["label 6", "step"]
