"""Rollout buffers between generators and learners.

The factories below are the only place that switches on ``buffer.type``.
"""

from __future__ import annotations

from asyncrl.config import BufferConfig
from asyncrl.wire.protocol import RolloutLimits
from buffers.base import BufferTimeout, Rejections, RolloutReader, RolloutWriter

__all__ = ["BufferTimeout", "Rejections", "RolloutReader", "RolloutWriter", "open_reader", "open_writer"]


def open_writer(config: BufferConfig) -> RolloutWriter:
    """The generator side of the configured buffer."""
    if config.type == "zmq":
        from buffers.zmq_buffer import ZmqWriter

        return ZmqWriter(config.address, config.capacity, config.curve_secret_file)
    if config.type == "inproc":
        from buffers.inproc import InprocWriter

        return InprocWriter(config.address, config.capacity)
    if config.type == "redis":
        from buffers.redis_writer import RedisWriter

        return RedisWriter(config)
    raise NotImplementedError(f"buffer.type: {config.type!r} is not available in this build")


def open_reader(config: BufferConfig, vocab_size: int | None = None) -> RolloutReader:
    """The learner side of the configured buffer; entries are checked against ``vocab_size``."""
    limits = RolloutLimits(max_bytes=config.max_message_bytes, vocab_size=vocab_size)
    if config.type == "zmq":
        from buffers.zmq_buffer import ZmqReader

        return ZmqReader(config.address, config.capacity, limits, config.curve_secret_file)
    if config.type == "inproc":
        from buffers.inproc import InprocReader

        return InprocReader(config.address, config.capacity)
    if config.type == "redis":
        from buffers.redis_reader import RedisReader

        return RedisReader(config, limits)
    raise NotImplementedError(f"buffer.type: {config.type!r} is not available in this build")
