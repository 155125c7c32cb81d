"""The learner's collectives across its ranks: rank 0's orders, per-token values, and the step's totals.

They travel over a gloo group of their own even when the engine uses NCCL:
they are small and host-side. Nothing between ranks is pickled: an order is
msgspec bytes, values are tensors end to end with their lengths.
"""

from __future__ import annotations

from dataclasses import fields

import msgspec
import torch
import torch.distributed as dist

from asyncrl.wire.protocol import StepOrder
from learners.policy_loss import LossCounts


def interleave(shards: list[list]) -> list:
    """Undo ``batch[rank::world_size]``: rank r's j-th item is the batch's item ``r + j * world_size``."""
    out = [None] * sum(len(shard) for shard in shards)
    for rank, shard in enumerate(shards):
        out[rank :: len(shards)] = shard
    return out


class Ranks:
    """One rank's view of the learner group, for the collectives every rank must run in the same order.

    ``group`` is None for a group of one: every collective is then the identity.
    """

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group

    @classmethod
    def join(cls, rank: int, world_size: int) -> Ranks:
        """The ranks of the initialised process group, with a gloo group of their own for these collectives."""
        return cls(rank, world_size, dist.new_group(backend="gloo") if world_size > 1 else None)

    def mine(self, items: list) -> list:
        """This rank's share of a batch: every ``world_size``-th item from its rank on."""
        return items[self.rank :: self.world_size]

    def exchange(self, order: StepOrder | None) -> StepOrder:
        """Rank 0's order, delivered to every rank (msgspec bytes over gloo)."""
        if self.group is None:
            return order
        data = msgspec.msgpack.encode(order) if self.rank == 0 else b""
        size = torch.tensor([len(data)])
        dist.broadcast(size, src=0, group=self.group)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        dist.broadcast(buffer, src=0, group=self.group)
        return order if self.rank == 0 else msgspec.msgpack.decode(buffer.numpy().tobytes(), type=StepOrder)

    def gather_shards(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's ``batch[rank::world_size]`` values (1-D float tensors on the CPU), back in batch order."""
        if self.group is None:
            return mine
        lengths = torch.tensor([len(v) for v in mine], dtype=torch.int64)
        values = torch.cat(mine).float() if mine else torch.zeros(0)
        sizes = self.all_gather(torch.tensor([len(mine), len(values)]))
        all_lengths = self.all_gather(lengths, max(int(size[0]) for size in sizes))
        all_values = self.all_gather(values, max(int(size[1]) for size in sizes))
        return interleave(
            [
                list(all_values[r][: int(sizes[r][1])].split(all_lengths[r][: int(sizes[r][0])].tolist()))
                for r in range(self.world_size)
            ]
        )

    def all_gather(self, tensor: torch.Tensor, size: int | None = None) -> list[torch.Tensor]:
        """Every rank's ``tensor``, padded with zeros to ``size`` elements first (all_gather takes equal sizes)."""
        if size is not None:
            tensor = torch.nn.functional.pad(tensor, (0, size - len(tensor)))
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        """``values`` combined element-wise over every rank (summed, unless ``op`` says otherwise)."""
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def max(self, value: int) -> int:
        """The largest ``value`` of any rank: how many micro-batches every rank runs, say."""
        return int(self.reduce([value], dist.ReduceOp.MAX)[0])

    def merge(self, totals: dict[str, float], counts: LossCounts) -> LossCounts:
        """The step's losses (``totals``, each rank's share in place) and statistics over every rank, not rank 0's."""
        losses = [key for key in ("loss", "value_loss") if key in totals]
        sums = [f.name for f in fields(LossCounts) if f.name != "is_ratio_max"]
        merged = self.reduce([totals[key] for key in losses] + [getattr(counts, name) for name in sums])
        totals.update(zip(losses, merged))
        return LossCounts(
            **dict(zip(sums, merged[len(losses) :])),
            is_ratio_max=self.reduce([counts.is_ratio_max], dist.ReduceOp.MAX)[0],
        )
