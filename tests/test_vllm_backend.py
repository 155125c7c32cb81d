"""The vLLM backend against transformers: log-probs, versioned weight updates, sampling options.

One engine serves the whole module (starting vLLM costs seconds). Every test
first loads the weights it needs as a new version, so the order of the tests
does not matter. The tiny model has heads of 32, the smallest size vLLM's
CPU attention has kernels for.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from conftest import one_generator_push, spike_state, stop_process  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from asyncrl.config import PushConfig  # noqa: E402
from asyncrl.launch import tiny_model  # noqa: E402
from asyncrl.weights import folders
from asyncrl.weights.push import open_group, spec_of  # noqa: E402
from asyncrl.weights.shared import SharedSegment, superseded  # noqa: E402
from asyncrl.weights.transports import FolderReceiver, SharedReceiver, announce_shared, folder_of  # noqa: E402
from asyncrl.wire.protocol import WeightUpdate  # noqa: E402
from generators import vllm_compat  # noqa: E402
from generators.base import GenerationRequest, PromptRefused, SamplingParams  # noqa: E402
from generators.staging import stage, sweep_stages  # noqa: E402
from generators.vllm_backend import VllmBackend  # noqa: E402

pytestmark = pytest.mark.slow

SPIKE_TOKEN = 10  # "7" in the character vocabulary


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def push_config(tmp_path_factory) -> PushConfig:
    return one_generator_push(tmp_path_factory.mktemp("push"), timeout_s=5.0)


@pytest.fixture(scope="module")
def backend(model_dir, push_config):
    # Prefix caching on, as on a GPU by default: every test then also checks that no KV cached under
    # an older version serves a request.
    engine = VllmBackend(str(model_dir), max_model_len=256, push=push_config, push_rank=1, enable_prefix_caching=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def sender(push_config):
    """Plays learner rank 0 of the push group."""
    group = open_group(push_config, 0, "cpu")
    yield group
    group.close()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


def base_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def other_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Random weights of the same shapes from another seed: every log-prob changes."""
    folder = tiny_model.build(tmp_path_factory.mktemp("seed1") / "model", seed=1)
    return load_file(folder / "model.safetensors")


def publish(backend, model_dir: Path, weights_dir: Path, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
    return folders.publish(
        state.items(),
        version=version,
        weights_dir=weights_dir,
        model_dir=model_dir,
        config_json=(model_dir / "config.json").read_text(),
        keep_versions=100,
    )


def take(backend, update) -> None:
    """Deliver an announced folder the way a generator does."""
    FolderReceiver().receive(update, backend, timeout_s=60)


def load(backend, model_dir, weights_dir, state) -> int:
    version = backend.version + 1
    take(backend, publish(backend, model_dir, weights_dir, state, version))
    assert backend.version == version
    return version


def requests(count: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", [1, 3 + i % 10, 3 + (i * 7) % 10, 13]) for i in range(count)]


def generate_all(backend, reqs, params):
    out = dict((req.request_id, samples) for req, samples in backend.generate(reqs, params))
    assert sorted(out) == sorted(r.request_id for r in reqs)
    return out


def reference_logprobs(folder: Path, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each response token, from transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


def assert_logprobs_match(backend, folder: Path, temperature: float = 0.7) -> None:
    reqs = requests(4)
    out = generate_all(backend, reqs, SamplingParams(n=2, max_new_tokens=24, temperature=temperature))
    worst, checked = 0.0, 0
    for req in reqs:
        for sample in out[req.request_id]:
            assert sample.versions == [backend.version] * len(sample.token_ids)
            expected = reference_logprobs(folder, req.prompt_ids, sample.token_ids, temperature)
            worst = max([worst] + [abs(a - b) for a, b in zip(sample.logprobs, expected)])
            checked += len(expected)
    assert checked > 20
    assert worst <= 1e-3, f"max |vLLM - transformers| log-prob difference {worst:.2e}"


def test_unsupported_head_size_fails_fast(tmp_path):
    folder = tiny_model.build(tmp_path / "h16", hidden_size=64, num_heads=4)  # 4 heads of 16: no CPU kernel
    with pytest.raises(ValueError, match="head_dim=16"):
        VllmBackend(str(folder))


def test_the_private_copies_of_a_killed_generator_are_swept(tmp_path):
    """A generator killed without closing its backend (SIGKILL, the OOM killer) leaves a private copy of a whole
    model next to the learner's versions (RAM, on /dev/shm), or in its stage folder. The next backend on the
    machine removes those of processes that no longer run, at its first load and when it opens."""
    host = socket.gethostname()
    folder = tmp_path / "weights" / "v000002"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    # Real processes: what matters is whether their pid is alive. They wait for a signal, not for time.
    killed = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    killed.kill()
    killed.wait()
    running = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        kept = [f".vllm-stage-{host}-{running.pid}", f".vllm-stage-elsewhere-{killed.pid}"]  # alive; another host's
        for name in [f".vllm-stage-{host}-{killed.pid}", *kept]:
            (tmp_path / "weights" / name / "v000001").mkdir(parents=True)
        (tmp_path / "stage" / f"asyncrl-vllm-{host}-{killed.pid}" / "v000001").mkdir(parents=True)
        staged = stage(folder, 2, str(tmp_path / "stage"))
        sweep_stages(tmp_path / "stage")  # what a backend does when it opens
        assert sorted(p.name for p in (tmp_path / "weights").glob(".vllm-stage-*")) == sorted(
            [*kept, staged.parent.name]
        )
        assert staged.parent.name == f".vllm-stage-{host}-{os.getpid()}"
        assert (staged / "model.safetensors").read_bytes() == b"weights" and not any((tmp_path / "stage").iterdir())
    finally:
        stop_process(running)


def test_a_retried_staging_never_shares_a_folder_with_an_attempt_that_ran_out_of_time(tmp_path):
    """The attempt before may still be copying (its thread is abandoned, not stopped): the retry stages into a
    folder of its own and removes the earlier one, so the earlier copy fails instead of writing into the
    folder the engine loads. The copy serving now is kept, even under the same version number (a learner
    that resumed publishes its version numbers again)."""
    folder = tmp_path / "weights" / "v000003"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"v3")
    serving = stage(folder, 3, None)
    abandoned = stage(folder, 3, None, keep=serving)
    retry = stage(folder, 3, None, keep=serving)
    assert len({serving, abandoned, retry}) == 3 and serving.parent == retry.parent
    assert serving.is_dir() and retry.is_dir() and not abandoned.exists()
    with pytest.raises(FileNotFoundError):  # what the abandoned attempt's next copy meets
        shutil.copy2(folder / "model.safetensors", abandoned / "model.safetensors")
    assert (retry / "model.safetensors").read_bytes() == b"v3"
    # an attempt abandoned at v3 goes when the next announcement, v4, is staged: no whole model left behind
    newer = tmp_path / "weights" / "v000004"
    newer.mkdir(parents=True)
    (newer / "model.safetensors").write_bytes(b"v4")
    abandoned = stage(folder, 3, None, keep=serving)
    staged = stage(newer, 4, None, keep=serving)
    assert sorted(serving.parent.iterdir()) == sorted([serving, staged]) and not abandoned.exists()
    shutil.rmtree(serving.parent)


def test_a_prompt_the_engine_refuses_fails_alone_and_the_engine_serves_on(backend):
    # max_model_len is 256: a prompt that fills it is refused as it is added. The requests added before it
    # are aborted, not left running for nobody, and the next batch is served as ever.
    batch = [*requests(2), GenerationRequest("too-long", [1] + [3] * 300)]
    with pytest.raises(PromptRefused, match="256"):  # the limit, in the words of each vLLM release
        list(backend.generate(batch, SamplingParams(n=1, max_new_tokens=4)))
    out = list(backend.generate(requests(2), SamplingParams(n=1, max_new_tokens=4, temperature=0.0)))
    assert sorted(r.request_id for r, _ in out) == ["q0", "q1"]
    assert all(len(samples[0].token_ids) == 4 for _, samples in out)


def test_an_evaluation_calls_back_between_engine_steps_to_renew_its_lease(backend):
    from asyncrl.wire.protocol import EvalTicket
    from generators.evaluate import evaluate

    calls = []
    ticket = EvalTicket(version=backend.version, indices=[0, 2], k=2, temperature=1.0, max_new_tokens=8)
    items = [{"prompt": f"{n}=", "label": str(n)} for n in range(3)]
    traces = evaluate(
        backend, ticket, items, lambda item: [1, 4, 5], lambda text, item: 0.0, between_steps=lambda: calls.append(1)
    )
    assert len(traces) == 2 * (1 + 2) and {t.label for t in traces} == {"0", "2"}
    assert len(calls) >= 8, "called between the steps of each of its two batches (8 tokens each)"


def test_logprobs_match_transformers_before_and_after_update(backend, model_dir, weights_dir, tmp_path_factory):
    load(backend, model_dir, weights_dir, base_state(model_dir))
    assert_logprobs_match(backend, model_dir)
    version = load(backend, model_dir, weights_dir, other_state(tmp_path_factory))
    assert_logprobs_match(backend, folders.version_dir(weights_dir, version))
    assert_logprobs_match(backend, folders.version_dir(weights_dir, version), temperature=1.3)


def test_a_cached_prefix_never_serves_a_newer_version_and_updates_flush_nothing(
    backend, model_dir, weights_dir, tmp_path_factory, monkeypatch
):
    """A prompt long enough to fill cache blocks, sampled before and after an update: after it, the
    log-probs are the new weights' (the old KV was not reused), and the update did not flush the cache."""
    flushes = []
    monkeypatch.setattr(backend.llm, "reset_prefix_cache", lambda *a, **k: flushes.append(k))
    prompt = [1] + [3 + (i * 5) % 10 for i in range(150)] + [13]  # more than a KV block (128 tokens on CPU)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.7)
    states = {"base": base_state(model_dir), "other": other_state(tmp_path_factory)}
    for name in ("base", "other", "base"):
        version = load(backend, model_dir, weights_dir, states[name])
        for _ in range(2):  # the second request hits the prefix the first one cached
            (samples,) = generate_all(backend, [GenerationRequest("long", prompt)], params).values()
            for sample in samples:
                expected = reference_logprobs(folders.version_dir(weights_dir, version), prompt, sample.token_ids, 0.7)
                worst = max(abs(a - b) for a, b in zip(sample.logprobs, expected))
                assert worst <= 1e-3, f"v{version} ({name}): log-probs off by {worst:.2e}: a stale prefix served it"
    assert flushes == []


def test_a_cached_prefix_never_serves_other_weights_under_the_same_version_number(
    backend, model_dir, weights_dir, tmp_path_factory
):
    """A learner resumed from a checkpoint publishes its version numbers again, with other weights."""
    prompt = [1] + [3 + (i * 7) % 10 for i in range(150)] + [13]
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.7)
    version = load(backend, model_dir, weights_dir, base_state(model_dir))
    generate_all(backend, [GenerationRequest("long", prompt)], params)  # cached under these weights
    resumed = tmp_path_factory.mktemp("resumed-learner")
    take(backend, publish(backend, model_dir, resumed, other_state(tmp_path_factory), version))
    assert backend.version == version
    (samples,) = generate_all(backend, [GenerationRequest("long", prompt)], params).values()
    for sample in samples:
        expected = reference_logprobs(folders.version_dir(resumed, version), prompt, sample.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(sample.logprobs, expected)) <= 1e-3, "a stale prefix served it"


def test_update_mid_generation_stamps_new_tokens(backend, model_dir, weights_dir):
    old = load(backend, model_dir, weights_dir, base_state(model_dir))
    update = publish(backend, model_dir, weights_dir, spike_state(model_dir, SPIKE_TOKEN), old + 1)
    params = SamplingParams(n=4, max_new_tokens=48, temperature=1.0)
    stream = backend.generate(requests(16), params)
    groups = [next(stream)]  # the first group is done; the others are still in flight
    take(backend, update)
    groups += list(stream)
    assert len(groups) == 16 and all(len(samples) == 4 for _, samples in groups)
    new_tokens, old_tokens, mixed = 0, 0, 0
    for _, samples in groups:
        for sample in samples:
            assert len(sample.versions) == len(sample.token_ids) == len(sample.logprobs)
            assert sample.versions == sorted(sample.versions)  # a sample never goes back in version
            for token, version in zip(sample.token_ids, sample.versions):
                assert version in (old, old + 1)
                if version == old + 1:
                    assert token == SPIKE_TOKEN
                    new_tokens += 1
                else:
                    old_tokens += 1
            mixed += len(set(sample.versions)) == 2
    assert new_tokens > 0 and old_tokens > 0 and mixed > 0


def test_failed_updates_keep_the_old_version(backend, model_dir, weights_dir, tmp_path):
    version = load(backend, model_dir, weights_dir, spike_state(model_dir, SPIKE_TOKEN))
    params = SamplingParams(n=2, max_new_tokens=5)

    def still_serving_old() -> None:
        assert backend.version == version
        for samples in generate_all(backend, requests(3), params).values():
            for sample in samples:
                assert sample.token_ids == [SPIKE_TOKEN] * 5 and sample.versions == [version] * 5

    # A wrong-shaped tensor next to weights that would visibly change the output.
    bad = spike_state(model_dir, 5)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wrong shape"):
        take(backend, publish(backend, model_dir, weights_dir, bad, version + 1))
    still_serving_old()

    # A missing tensor: vLLM itself would only warn and keep the stale one.
    partial = spike_state(model_dir, 5)
    del partial["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        take(backend, publish(backend, model_dir, weights_dir, partial, version + 1))
    still_serving_old()

    # A pruned folder and a truncated file.
    with pytest.raises(FileNotFoundError):
        take(backend, WeightUpdate(version + 1, (tmp_path / "gone").as_uri(), 0, 0.0))
    update = publish(backend, model_dir, weights_dir, spike_state(model_dir, 5), version + 1)
    file = folder_of(update) / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        take(backend, update)
    still_serving_old()


def test_engine_failure_midway_rolls_back(backend, model_dir, weights_dir, monkeypatch):
    """If a bad checkpoint gets past the checks, the half-done load is undone."""
    version = load(backend, model_dir, weights_dir, spike_state(model_dir, SPIKE_TOKEN))
    bad = spike_state(model_dir, 5)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)  # after most layers loaded
    update = publish(backend, model_dir, weights_dir, bad, version + 1)
    monkeypatch.setattr(backend, "_check_and_stage", lambda folder, version: backend.stage(folder, version))
    with pytest.raises(RuntimeError, match="engine failed"):
        take(backend, update)
    monkeypatch.undo()
    assert backend.version == version
    for samples in generate_all(backend, requests(2), SamplingParams(n=2, max_new_tokens=4)).values():
        assert all(s.token_ids == [SPIKE_TOKEN] * 4 for s in samples)
    load(backend, model_dir, weights_dir, spike_state(model_dir, 5))  # and it still takes good updates
    for samples in generate_all(backend, requests(2), SamplingParams(n=1, max_new_tokens=3)).values():
        assert samples[0].token_ids == [5, 5, 5]


def test_n_stop_strings_max_tokens_and_finish_reasons(backend, model_dir, weights_dir):
    eos = backend.tokenizer.eos_token_id
    load(backend, model_dir, weights_dir, spike_state(model_dir, SPIKE_TOKEN))
    out = generate_all(backend, requests(3), SamplingParams(n=3, max_new_tokens=7, stop=("777",)))
    for samples in out.values():
        assert len(samples) == 3
        for s in samples:
            assert (s.token_ids, s.text, s.finish_reason) == ([SPIKE_TOKEN] * 3, "777", "stop")
    out = generate_all(backend, requests(2), SamplingParams(n=5, max_new_tokens=7, stop=("5",)))
    for samples in out.values():
        assert len(samples) == 5
        for s in samples:
            assert (s.token_ids, s.text, s.finish_reason) == ([SPIKE_TOKEN] * 7, "7777777", "length")

    load(backend, model_dir, weights_dir, spike_state(model_dir, eos))
    for samples in generate_all(backend, requests(2), SamplingParams(n=2, max_new_tokens=7)).values():
        for s in samples:
            assert (s.token_ids, s.text, s.finish_reason) == ([eos], "", "stop")

    # Random weights: every finish reason must be consistent with the tokens and text.
    load(backend, model_dir, weights_dir, base_state(model_dir))
    out = generate_all(backend, requests(8), SamplingParams(n=4, max_new_tokens=10, stop=("5",)))
    reasons = set()
    for samples in out.values():
        assert len(samples) == 4
        for s in samples:
            reasons.add(s.finish_reason)
            assert 1 <= len(s.token_ids) <= 10
            assert s.text == backend.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            assert "5" not in s.text[:-1]
            if s.finish_reason == "length":
                assert len(s.token_ids) == 10 and eos not in s.token_ids and "5" not in s.text
            else:
                assert s.token_ids[-1] == eos or s.text.endswith("5")
                assert eos not in s.token_ids[:-1]
    assert reasons == {"stop", "length"}


def test_text_decoded_after_the_engine_matches_the_engines_own(backend, model_dir, weights_dir):
    # Without stop strings the engine skips detokenizing and the backend decodes each finished sample;
    # greedy, with a stop string that never occurs, the engine detokenizes the same tokens itself.
    load(backend, model_dir, weights_dir, base_state(model_dir))
    ours = generate_all(backend, requests(6), SamplingParams(n=1, max_new_tokens=12, temperature=0.0))
    engines = generate_all(
        backend, requests(6), SamplingParams(n=1, max_new_tokens=12, temperature=0.0, stop=("never-in-output",))
    )
    texts = 0
    for request_id, (sample,) in ours.items():
        (theirs,) = engines[request_id]
        assert sample.token_ids == theirs.token_ids
        assert sample.text == theirs.text
        texts += bool(sample.text)
    assert texts >= 3


def test_tokenizer_matches_the_model(backend, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert len(backend.tokenizer) == config["vocab_size"]
    assert backend.tokenizer("12=3").input_ids[0] == config["bos_token_id"]


# --- weights pushed over the process group (gloo here, NCCL on GPU) ---------------------------------


def push(backend, sender, state, version, epoch, tensors=None):
    """Send ``state`` from a thread (as learner rank 0 would) while the engine receives it."""
    specs = [spec_of(name, tensor) for name, tensor in state.items()]
    sent: list = []

    def send():
        try:
            sent.append(sender.send(epoch, version, specs, tensors or state.items(), bucket_bytes=256 * 1024))
        except Exception as error:  # noqa: BLE001  (the test checks the receiving side)
            sent.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        backend.receive_push(epoch, version, timeout_s=60)
    finally:
        thread.join(timeout=30)
    return sent[0]


def test_push_loads_the_whole_version_in_place(backend, sender, model_dir, weights_dir, tmp_path_factory):
    version = backend.version + 1
    stats = push(backend, sender, spike_state(model_dir, SPIKE_TOKEN), version, epoch=1)
    assert stats.num_buckets > 1 and backend.version == version
    for samples in generate_all(backend, requests(3), SamplingParams(n=2, max_new_tokens=5)).values():
        assert all(s.token_ids == [SPIKE_TOKEN] * 5 and s.versions == [version] * 5 for s in samples)
    # Log-probs after a push match transformers on the same weights.
    state = other_state(tmp_path_factory)
    push(backend, sender, state, version + 1, epoch=1)
    assert_logprobs_match(
        backend, folders.version_dir(weights_dir, publish(None, model_dir, weights_dir, state, version + 1).version)
    )


def test_failed_push_keeps_the_old_version(backend, sender, model_dir, monkeypatch):
    version = backend.version + 1
    push(backend, sender, spike_state(model_dir, SPIKE_TOKEN), version, epoch=2)

    def still_serving_old() -> None:
        assert backend.version == version
        for samples in generate_all(backend, requests(2), SamplingParams(n=2, max_new_tokens=4)).values():
            assert all(s.token_ids == [SPIKE_TOKEN] * 4 and s.versions == [version] * 4 for s in samples)

    # The learner dies half-way: the engine waits out the timeout and loads nothing.
    state = spike_state(model_dir, 5)

    def dies_half_way():
        for i, item in enumerate(state.items()):
            if i == len(state) // 2:
                raise RuntimeError("learner lost")
            yield item

    with pytest.raises(TimeoutError, match="timed out"):
        push(backend, sender, state, version + 1, epoch=2, tensors=dies_half_way())
    still_serving_old()

    # A push whose tensors do not fit the model is rejected before anything is loaded.
    bad = spike_state(model_dir, 5)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wrong shape"):
        push(backend, sender, bad, version + 1, epoch=3)
    still_serving_old()

    # The engine's loader fails part-way through a whole, validated push: the engine goes back to the last
    # folder it loaded, whole, and says so.
    real = vllm_compat.reload_weights_from_tensors

    def fails_half_way(worker, tensors):
        tensors = list(tensors)
        real(worker, [*tensors[: len(tensors) // 2], ("model.norm.weight", None)])

    monkeypatch.setattr(vllm_compat, "reload_weights_from_tensors", fails_half_way)
    good = backend._good_version
    with pytest.raises(RuntimeError, match=f"engine failed to load them; serving v{good} from"):
        push(backend, sender, spike_state(model_dir, 5), version + 1, epoch=4)
    monkeypatch.undo()
    assert backend.version == good
    for samples in generate_all(backend, requests(1), SamplingParams(n=1, max_new_tokens=3)).values():
        assert samples[0].versions == [good] * 3

    # The next push forms a new group and lands.
    push(backend, sender, spike_state(model_dir, 5), version + 1, epoch=5)
    for samples in generate_all(backend, requests(2), SamplingParams(n=1, max_new_tokens=3)).values():
        assert samples[0].token_ids == [5, 5, 5] and samples[0].versions == [version + 1] * 3


def shared_segment(state: dict[str, torch.Tensor]) -> SharedSegment:
    return SharedSegment([spec_of(name, t) for name, t in state.items()], "cpu")


def test_shared_weights_load_in_place_and_a_superseded_version_changes_nothing(
    backend, model_dir, weights_dir, tmp_path_factory
):
    version = backend.version + 1
    spike = spike_state(model_dir, SPIKE_TOKEN)
    segment = shared_segment(spike)
    segment.write(version, spike.items())
    SharedReceiver().receive(announce_shared(version, segment.handle, segment.num_bytes), backend, timeout_s=60)
    assert backend.version == version
    for samples in generate_all(backend, requests(3), SamplingParams(n=2, max_new_tokens=5)).values():
        assert all(s.token_ids == [SPIKE_TOKEN] * 5 and s.versions == [version] * 5 for s in samples)
    # The learner has already written the next version: the announced one is skipped, nothing changes.
    segment.write(version + 2, spike_state(model_dir, 5).items())
    with pytest.raises(Exception, match="Superseded: .*already holds") as raised:
        backend.load_shared(segment.handle, version + 1, timeout_s=60)
    assert superseded(raised.value) and backend.version == version
    # Log-probs after a shared load match transformers on the same weights.
    state = other_state(tmp_path_factory)
    segment.write(version + 3, state.items())
    backend.load_shared(segment.handle, version + 3, timeout_s=60)
    assert_logprobs_match(
        backend, folders.version_dir(weights_dir, publish(None, model_dir, weights_dir, state, version + 3).version)
    )
    segment.close()
