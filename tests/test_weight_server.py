"""Weights over ZeroMQ: a generator with no shared file system fetches what the learner published."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, offered_files, wait_for
from transformers import AutoModelForCausalLM

from asyncrl.weights import folders
from asyncrl.weights.served import CHUNK_BYTES, DELTA_NAME, WEIGHTS_FILE, WeightServer, fetch
from asyncrl.weights.transports import folder_of
from asyncrl.wire.protocol import WeightChunk

MODEL = ROOT / "assets/tiny-llama"


@pytest.fixture
def served(tmp_path, tcp_address):
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    # A tensor over one chunk, so the transfer takes several requests.
    state = dict(model.state_dict(), extra=torch.arange(CHUNK_BYTES // 4 + 10, dtype=torch.float32))
    update = folders.publish(
        state.items(),
        version=4,
        weights_dir=tmp_path / "learner",
        model_dir=MODEL,
        config_json=model.config.to_json_string(),
    )
    server = WeightServer(tmp_path / "learner", tcp_address)
    yield update, tcp_address
    server.close()


def test_fetch_copies_the_whole_version(served, tmp_path):
    update, address = served
    fetched = fetch(4, address, tmp_path / "cache", timeout_s=10)
    source = folder_of(update)
    assert fetched.parent == tmp_path / "cache" and fetched != source
    for path in source.iterdir():
        assert (fetched / path.name).read_bytes() == path.read_bytes(), path.name
    assert torch.equal(folders.read_state_dict(fetched, 4)["extra"], folders.read_state_dict(source, 4)["extra"])


def test_missing_version_is_an_error_and_leaves_nothing(served, tmp_path):
    _, address = served
    with pytest.raises(FileNotFoundError, match="v9 is not published"):
        fetch(9, address, tmp_path / "cache", timeout_s=10)
    assert not any((tmp_path / "cache").iterdir())


def test_a_version_pruned_while_being_served_is_an_error_naming_it(served, tmp_path, monkeypatch):
    _, address = served
    listing = Path.iterdir

    def pruned_first(folder):  # the learner prunes the version between the server's check and its listing
        if folder.parent == tmp_path / "learner":
            shutil.rmtree(folder)
        return listing(folder)

    monkeypatch.setattr(Path, "iterdir", pruned_first)
    with pytest.raises(FileNotFoundError, match="v4 was pruned while being served"):
        fetch(4, address, tmp_path / "cache", timeout_s=10)
    assert not any((tmp_path / "cache").iterdir())


def test_a_fetch_under_way_finishes_from_the_files_it_began_on_when_the_version_is_pruned(tmp_path, tcp_address):
    """A generator on a slow link may take longer than a few publishes to fetch a version: the learner's pruning
    must not cut it short, or such a generator would never finish one."""
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    state = dict(model.state_dict(), extra=torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32))  # 3 chunks
    update = folders.publish(
        state.items(), version=4, weights_dir=tmp_path / "learner", model_dir=MODEL, config_json="{}"
    )
    source = folder_of(update)
    kept = Path(shutil.copytree(source, tmp_path / "kept"))

    class PrunedOnceListed(WeightServer):
        def _answer(self, request, final=True):
            answer = super()._answer(request, final)
            if not request.name and source.exists():  # the learner prunes v4 as the fetch begins
                shutil.rmtree(source)
            return answer

    server = PrunedOnceListed(tmp_path / "learner", tcp_address)
    try:
        fetched = fetch(4, tcp_address, tmp_path / "cache", timeout_s=10)
        for path in kept.iterdir():
            assert (fetched / path.name).read_bytes() == path.read_bytes(), path.name
        with pytest.raises(FileNotFoundError, match="v9 is not published"):  # a version never listed: as before
            fetch(9, tcp_address, tmp_path / "cache", timeout_s=10)
    finally:
        server.close()


class FailingServer(WeightServer):
    """A server whose every answer fails, as on a disk error."""

    def _answer(self, request, final=True):
        raise OSError("the disk failed")


def test_a_server_failure_reaches_the_generator_with_its_reason(tmp_path, tcp_address):
    server = FailingServer(tmp_path / "learner", tcp_address)
    try:
        with pytest.raises(FileNotFoundError) as failure:
            fetch(4, tcp_address, tmp_path / "cache", timeout_s=10)
    finally:
        server.close()
    assert all(part in str(failure.value) for part in ("weights v4", tcp_address, "OSError: the disk failed"))
    assert not any((tmp_path / "cache").iterdir())


class MislistingServer(WeightServer):
    """Lists one file under ``listed``, a name no file of a version may have, and serves its bytes."""

    def __init__(self, listed, *args, **kwargs):
        self.listed = listed
        super().__init__(*args, **kwargs)

    def _answer(self, request, final=True):
        if not request.name:
            return WeightChunk(version=request.version, files={self.listed: 3})
        return WeightChunk(
            version=request.version, name=request.name, offset=request.offset, data=b"bad"[request.offset :]
        )


@pytest.mark.parametrize("listed", ["../../escaped", "/absolute", "..", ""])
def test_a_file_name_that_is_a_path_is_refused_and_nothing_is_written(tmp_path, tcp_address, listed):
    listed = str(tmp_path / "escaped") if listed == "/absolute" else listed
    server = MislistingServer(listed, tmp_path / "learner", tcp_address)
    try:
        with pytest.raises(ValueError, match="not a plain file name") as failure:
            fetch(4, tcp_address, tmp_path / "cache", timeout_s=10)
    finally:
        server.close()
    assert repr(listed) in str(failure.value) and tcp_address in str(failure.value)
    assert not (tmp_path / "escaped").exists() and not any((tmp_path / "cache").iterdir())


def test_unreachable_server_times_out(tmp_path, tcp_address):
    with pytest.raises(TimeoutError, match="no answer"):
        fetch(1, tcp_address, tmp_path / "cache", timeout_s=0.3)


class RecordingServer(WeightServer):
    """Records the file of each chunk it sends, as (version, name)."""

    def __init__(self, *args, **kwargs):
        self.sent = []
        super().__init__(*args, **kwargs)

    def _answer(self, request, final=True):
        if request.name:
            self.sent.append((request.version, request.name))
        return super()._answer(request, final)


def _publish(tmp_path, version, state):
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    return folders.publish(
        state.items(),
        version=version,
        weights_dir=tmp_path / "learner",
        model_dir=MODEL,
        config_json=model.config.to_json_string(),
        keep_versions=5,
    )


@pytest.mark.parametrize("deltas", [True, False])
def test_a_generator_holding_a_version_fetches_only_the_difference(tmp_path, tcp_address, caplog, deltas):
    state = {k: v.bfloat16() for k, v in AutoModelForCausalLM.from_pretrained(MODEL).state_dict().items()}
    _publish(tmp_path, 1, state)
    moved = {k: (v.float() + 0.05 * (torch.rand_like(v.float()) < 0.1)).bfloat16() for k, v in state.items()}
    source = folder_of(_publish(tmp_path, 2, moved))
    server = RecordingServer(tmp_path / "learner", tcp_address, deltas=deltas)
    try:
        fetch(1, tcp_address, tmp_path / "cache", timeout_s=10)
        with caplog.at_level("INFO", logger="asyncrl.weights.served"):
            # Asked first right after the announcement, as generators do: the file list waits for the delta.
            fetched = fetch(2, tcp_address, tmp_path / "cache", timeout_s=10, base=1)
    finally:
        server.close()
    assert ("weights v2: applied the delta from v1" in caplog.text) == deltas
    # With deltas the whole weights file never crosses the wire: the delta takes its place.
    sent = {name for version, name in server.sent if version == 2}
    others = {p.name for p in source.iterdir()} - {WEIGHTS_FILE}
    assert sent == others | ({DELTA_NAME} if deltas else {WEIGHTS_FILE})
    got, want = folders.read_state_dict(fetched, 2), folders.read_state_dict(source, 2)
    assert got.keys() == want.keys() and all(
        torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
    )
    assert sorted(p.name for p in fetched.iterdir()) == sorted(p.name for p in source.iterdir())


def test_a_base_the_server_no_longer_has_gets_the_whole_version(served, tmp_path):
    _, address = served
    fetched = fetch(4, address, tmp_path / "cache", timeout_s=10, base=3)  # nothing held: whole
    assert (fetched / "model.safetensors").exists() and not (fetched / "model.safetensors.delta").exists()


def test_a_delta_is_computed_while_the_server_answers_on_with_whole_files(tmp_path, tcp_address):
    """A large model's delta takes seconds: no client waits for one, so none times out meanwhile."""
    state = {k: v.bfloat16() for k, v in AutoModelForCausalLM.from_pretrained(MODEL).state_dict().items()}
    _publish(tmp_path, 1, state)
    source = folder_of(_publish(tmp_path, 2, {k: (v.float() * 1.01).bfloat16() for k, v in state.items()}))
    server = WeightServer(tmp_path / "learner", tcp_address)
    try:
        fetch(1, tcp_address, tmp_path / "cache", timeout_s=10)
        offered = offered_files(tcp_address, 2, base=1)  # the first ask: nothing computed yet
        assert WEIGHTS_FILE in offered and DELTA_NAME not in offered
        got = folders.read_state_dict(fetch(2, tcp_address, tmp_path / "cache", timeout_s=10, base=1), 2)
        want = folders.read_state_dict(source, 2)
        assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want)
        wait_for(lambda: DELTA_NAME in offered_files(tcp_address, 2, base=1))  # ready for the next generator
    finally:
        server.close()


def _noise(version: int, changed: float) -> torch.Tensor:
    """A bf16 tensor that differs from version 0's in a random ``changed`` fraction of its values."""
    values = torch.randn(2**18, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(version)
    moved = torch.rand(values.shape, generator=generator) < changed
    return torch.where(moved, torch.randn(values.shape, generator=generator), values).bfloat16()


def _publish_noise(tmp_path, versions, changed):
    for version in versions:
        folders.publish(
            [("w", _noise(version, changed))],
            version=version,
            weights_dir=tmp_path / "learner",
            model_dir=MODEL,
            config_json="{}",
            keep_versions=10,
        )
    return (folders.version_dir(tmp_path / "learner", versions[-1]) / WEIGHTS_FILE).stat().st_size


def test_a_delta_over_half_the_file_is_not_sent(tmp_path, tcp_address, caplog):
    """Nearly every value moved: the whole file costs the generator no more on the wire and saves applying."""
    caplog.set_level("INFO", logger="asyncrl.weights.served")
    _publish_noise(tmp_path, [1, 2], changed=0.9)
    server = WeightServer(tmp_path / "learner", tcp_address)
    try:
        offered_files(tcp_address, 2, base=1)
        wait_for(lambda: "delta v1 -> v2" in caplog.text)
        assert "over half of the file" in caplog.text
        assert DELTA_NAME not in offered_files(tcp_address, 2, base=1)
    finally:
        server.close()


def test_the_delta_cache_is_bounded_in_bytes_and_keeps_the_newest(tmp_path, tcp_address):
    size = _publish_noise(tmp_path, [1, 2, 3, 4, 5, 6], changed=0.15)  # each delta to v6: about 30% of the file
    server = WeightServer(tmp_path / "learner", tcp_address, delta_cache_bytes=size)
    try:
        for base in (1, 2, 3, 4, 5):  # generators one to five versions behind
            wait_for(lambda base=base: DELTA_NAME in offered_files(tcp_address, 6, base=base))
        assert DELTA_NAME in offered_files(tcp_address, 6, base=5)
        assert DELTA_NAME not in offered_files(tcp_address, 6, base=1)  # five deltas are over one file: the oldest went
    finally:
        server.close()


def test_a_server_of_another_learner_is_named_and_a_generator_stops_on_it_only_when_it_persists(served, tmp_path):
    from conftest import FakeClock

    from asyncrl.config import load_config
    from asyncrl.weights.served import OtherLearner
    from asyncrl.wire.protocol import WeightUpdate
    from generators.weight_updates import OTHER_LEARNER_FATAL_S, WeightUpdater

    _, address = served
    elsewhere = f"tcp://127.0.0.1:{free_port()}"
    other = WeightServer(tmp_path / "learner", elsewhere, session="s-other")
    try:
        # the coordinator announced session s-ours; the address serves another learner's (s-other)
        with pytest.raises(OtherLearner, match=rf"coordinator.weights_address {elsewhere} serves .* s-other, not "):
            fetch(4, elsewhere, tmp_path / "cache", timeout_s=10, session="s-ours")
        assert fetch(4, elsewhere, tmp_path / "mine", timeout_s=10, session="s-other").is_dir()
    finally:
        other.close()
    assert fetch(4, address, tmp_path / "any", timeout_s=10, session="s-ours").is_dir(), "no session served: any"

    class Elsewhere:  # every fetch finds another learner's server
        def wants(self, update, serving):
            return True

        def receive(self, update, backend, timeout_s):
            raise OtherLearner("tcp://198.18.0.2:5557", "s-other", update.session)

    class Backend:
        version = 0

    clock = FakeClock()
    updater = WeightUpdater(load_config(None, []), "gen-0", Backend(), Elsewhere(), clock=clock)
    update = WeightUpdate(version=3, transport="served", session="s-ours")
    updater.apply(update)  # right after a learner restart this passes: the next announcement names the new one
    assert updater.failures == 1
    clock.advance(OTHER_LEARNER_FATAL_S - 1)
    updater.apply(update)
    with pytest.raises(OtherLearner, match="198.18.0.2:5557 serves the weights of learner session s-other"):
        clock.advance(1.0)
        updater.apply(update)


def test_an_older_announcement_of_the_same_learner_never_takes_the_weights_back():
    """A version held back while an evaluation piece ran may be applied after a newer one loaded meanwhile (say,
    while a full buffer was waited out): the generator keeps the newer weights. A restarted learner's versions
    (another session) load whatever their number."""
    from asyncrl.config import load_config
    from asyncrl.wire.protocol import WeightUpdate
    from generators.weight_updates import WeightUpdater

    class Backend:
        version = 0

    class Loads:
        def wants(self, update, serving):
            return update.identity != serving

        def receive(self, update, backend, timeout_s):
            backend.version = update.version

    backend = Backend()
    updater = WeightUpdater(load_config(None, []), "gen-0", backend, Loads())
    updater.apply(WeightUpdate(version=4, session="s1"))
    updater.apply(WeightUpdate(version=3, session="s1"))
    assert (updater.session, backend.version) == ("s1", 4)
    updater.apply(WeightUpdate(version=2, session="s2"))  # resumed from an earlier checkpoint
    assert (updater.session, backend.version) == ("s2", 2)
