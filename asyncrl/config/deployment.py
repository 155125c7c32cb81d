"""How a run's processes reach each other and where they run: buffer, coordinator, weight push, Prometheus, Ray.

A field's ``#`` comments are its ``--help`` text, as in :mod:`asyncrl.config.sections`.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from asyncrl.config.sections import Section
from asyncrl.wire.ports import is_loopback_host


class BufferConfig(Section):
    """The rollout transport between generators and learners."""

    type: Literal["zmq", "inproc", "redis"] = "zmq"  # inproc: within one process (tests), not for asyncrl run
    address: str = "tcp://127.0.0.1:5555"  # zmq: the learner binds it; inproc: a queue name
    capacity: int = 1024  # rollouts queued between the two sides
    timeout_s: float = 30.0
    # An entry larger than this is rejected before it is decoded (a 128k-token rollout is about 2 MB).
    max_message_bytes: int = 16 * 2**20
    curve_secret_file: str | None = None  # zmq: required when binding off loopback
    # redis: the stream, its consumer group and the connection
    redis_url: str = "redis://127.0.0.1:6379/0"  # rediss:// for TLS
    redis_username: str | None = None  # an ACL user
    redis_password_file: str | None = None  # read at start; never put the password in the config
    stream: str = "asyncrl:rollouts"
    consumer_group: str = "learners"
    consumer: str = "learner-0"  # stable across restarts, so a resumed learner gets its pending entries back
    claim_idle_s: float = 60.0  # pending entries of a consumer idle this long are reclaimed
    socket_timeout_s: float = 5.0
    retries: int = 5
    # redis: how long learner and generators wait out an unreachable server (with backoff) before failing
    outage_tolerance_s: float = 60.0

    def redis_open_beyond_loopback(self) -> bool:
        """Whether ``redis_url`` names a Redis on another machine (or a name that may be one) with no password
        file."""
        parts = urlsplit(self.redis_url)
        if parts.scheme == "unix" or self.redis_password_file:
            return False
        return not is_loopback_host(parts.hostname or "127.0.0.1")


class CoordinatorConfig(Section):
    """The learner's control endpoint: prompt tickets, weight versions, status."""

    address: str = "tcp://127.0.0.1:5556"
    timeout_s: float = 10.0
    generator_lease_s: float = 60.0  # a silent generator's tickets are reissued after this
    ticket_timeout_s: float = 600.0  # a ticket whose group never arrived is reissued after this
    # A generator's request for work waits up to this long at the learner when no work can be
    # admitted yet, and is answered the moment a new version or free slots appear (0: ask and sleep).
    long_poll_s: float = 1.0
    # Serve published weights over ZeroMQ here (generators without a shared file system);
    # unset: generators read learner.weights_dir directly.
    weights_address: str | None = None
    # With weights_address: send a generator only what changed since the version it holds
    # (a lossless, compressed bit-level difference) instead of the whole model.
    weight_deltas: bool = True
    curve_secret_file: str | None = None
    # The run's identity, which asyncrl run gives every process it starts: a generator of another run that
    # reaches this learner (a port that run used before) is answered with an error and waits, instead of taking
    # this run's work. "": not checked (a generator started by hand with the config file alone).
    run_id: str = ""


class PrometheusConfig(Section):
    """Prometheus /metrics endpoints (prometheus-client); each is off until its port is set."""

    learner_port: int | None = None  # learner rank 0
    generator_port: int | None = None  # the first generator; asyncrl run and --replicas count up from it
    host: str = "127.0.0.1"  # anything but loopback requires secret_file
    secret_file: str | None = None  # password for HTTP basic auth (user asyncrl); never put it in the config


class PushConfig(Section):
    """Weight push from learner rank 0 straight into the generators' engines over a process group.

    NCCL between GPUs, gloo on CPU; no folders are written. Unset ``address``:
    versions travel as folders (``learner.weights_dir`` or ``coordinator.weights_address``).
    """

    address: str | None = None  # HOST:PORT of the rendezvous store learner rank 0 hosts
    generators: int = 1  # receiving engines; generator.push_rank numbers them 1..generators
    bucket_mb: int = 256  # MiB per broadcast (two buckets in flight on the sender)
    # the limit on each wait of a push (forming the group, the manifest, each bucket), not on the whole;
    # a wait that runs out abandons the push and generators keep the old version
    timeout_s: float = 60.0
    background: bool = True  # learner rank 0 broadcasts from a thread, from a gathered copy, while training goes on
    # a shared secret keying the rendezvous: the learner and generators refuse to start with an address and
    # none (the store listens on every interface); `asyncrl run` writes one for a loopback address
    secret_file: str | None = None


class RayConfig(Section):
    """Placement and supervision on a Ray cluster (``asyncrl run --ray``).

    Ray places and restarts the processes; rollouts and weights still travel
    through the buffer and the weight transport, never through Ray.
    """

    max_restarts: int = 3  # a generator actor that dies is restarted by Ray this many times (-1: always)
    generator_cpus: float = 1.0  # per generator actor (also its torch threads, where generator.torch_threads is unset)
    # per generator actor; None: generator.vllm.tensor_parallel_size on a cluster with GPUs, else 0
    generator_gpus: float | None = None
    learner_cpus: float = 1.0  # per learner rank (one bundle of the learner's placement group)
    learner_gpus: float | None = None  # per learner rank; None: 1 on a cluster with GPUs, else 0
    start_timeout_s: float = 300.0  # the learner's placement group must be placed within this
    drain_timeout_s: float = 60.0  # a generator removed by `asyncrl scale` finishes its batch within this
    # The local instance `asyncrl run --ray` starts without an address: its logical CPUs. None: four
    # per core (at least what the starting actors need), so that `asyncrl scale` can add generators;
    # every actor's torch threads still follow its ray.*_cpus.
    local_cpus: int | None = None


class MpsConfig(Section):
    """CUDA MPS for ``asyncrl run`` on one machine, where the learner and its generators share a GPU.

    Processes on one GPU take turns on it; under MPS (NVIDIA's Multi-Process
    Service) one server runs the kernels of all of them side by side, which
    is what overlapping generation with training on one GPU needs. The run
    starts a control daemon of its own (its sockets in a private folder,
    its logs in RUN_DIR/logs/mps), points its processes at it, and stops it
    when the run ends. A process that cannot reach it runs without MPS.
    """

    # auto: on where the learner and a generator share a GPU and the control program is installed
    enabled: bool | Literal["auto"] = False
    control: str = "nvidia-cuda-mps-control"  # the control program: a name on PATH or a path
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the share of the GPU's SMs a generator or the learner may use (None: all)
    generator_thread_percentage: int | None = None
    learner_thread_percentage: int | None = None
    timeout_s: float = 30.0  # the daemon's start, each query, and its stop

    def __post_init__(self) -> None:
        for side in ("generator", "learner"):
            share = getattr(self, f"{side}_thread_percentage")
            if share is not None and not 1 <= share <= 100:
                raise ValueError(f"mps.{side}_thread_percentage must be in [1, 100], got {share}")


def placement_checks(ray: RayConfig, devices: str | None, tensor_parallel_size: int) -> list[tuple[bool, str, str]]:
    """Placement: on Ray, and the GPUs a generator's engine takes (``generator.devices``; its
    ``generator.vllm.tensor_parallel_size`` workers each take one)."""
    tp = tensor_parallel_size
    return [
        (ray.max_restarts >= -1, "ray.max_restarts", "must be >= 0, or -1 for no limit"),
        (
            ray.generator_cpus >= 0 and (ray.generator_gpus or 0) >= 0,
            "ray.generator_cpus",
            "ray.generator_cpus and ray.generator_gpus must be >= 0",
        ),
        (
            ray.learner_cpus > 0 and (ray.learner_gpus or 0) >= 0,
            "ray.learner_cpus",
            "ray.learner_cpus must be > 0 (a placement group bundle cannot be empty), ray.learner_gpus >= 0",
        ),
        (ray.local_cpus is None or ray.local_cpus >= 1, "ray.local_cpus", "must be >= 1"),
        (
            not devices or len(devices.split(",")) >= tp,
            "generator.devices",
            f"lists fewer GPUs than generator.vllm.tensor_parallel_size ({tp}): an engine's workers each take one",
        ),
        (
            tp == 1 or ray.generator_gpus in (None, 0) or ray.generator_gpus >= tp,  # one worker: a share (0.5) is fine
            "ray.generator_gpus",
            f"is below generator.vllm.tensor_parallel_size ({tp}): an engine's workers each take one GPU",
        ),
    ]
