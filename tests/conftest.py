"""Shared fixtures: valid rollouts and free loopback ports."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_rollout(i: int = 0, group: str = "s-g0", group_size: int = 1, versions: list[int] | None = None,
                 reward: float = 0.5, n_tokens: int = 3):
    from asyncrl.protocol import Rollout

    versions = versions or [0] * n_tokens
    return Rollout(
        rollout_id=f"{group}-{i}", group_id=group, group_size=group_size, prompt_index=i,
        prompt_ids=[1, 4, 5, 13], response_ids=[5, 4, 2][:len(versions)] + [3] * max(0, len(versions) - 3),
        logprobs=[-0.5] * len(versions), versions=versions, reward=reward, finish_reason="stop",
        generator_id="gen-0", created_s=0.0,
    )


@pytest.fixture
def rollout_factory():
    return make_rollout


@pytest.fixture
def tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable
