"""Rollout buffers between generators and learners.

The factories below are the only place that switches on ``buffer.type``.
"""

from __future__ import annotations

from asyncrl.config import BufferConfig
from buffers.base import BufferTimeout, RolloutReader, RolloutWriter

__all__ = ["BufferTimeout", "RolloutReader", "RolloutWriter", "open_reader", "open_writer"]


def open_writer(config: BufferConfig) -> RolloutWriter:
    """The generator side of the configured buffer."""
    if config.type == "zmq":
        from buffers.zmq_buffer import ZmqWriter

        return ZmqWriter(config.address, config.capacity, config.curve_secret_file)
    if config.type == "inproc":
        from buffers.inproc import InprocWriter

        return InprocWriter(config.address, config.capacity)
    if config.type == "redis":
        from buffers.redis_buffer import RedisWriter

        return RedisWriter(config)
    raise NotImplementedError(f"buffer.type: {config.type!r} is not available in this build")


def open_reader(config: BufferConfig) -> RolloutReader:
    """The learner side of the configured buffer."""
    if config.type == "zmq":
        from buffers.zmq_buffer import ZmqReader

        return ZmqReader(config.address, config.capacity, config.curve_secret_file)
    if config.type == "inproc":
        from buffers.inproc import InprocReader

        return InprocReader(config.address, config.capacity)
    if config.type == "redis":
        from buffers.redis_buffer import RedisReader

        return RedisReader(config)
    raise NotImplementedError(f"buffer.type: {config.type!r} is not available in this build")
