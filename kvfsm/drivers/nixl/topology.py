"""Who reads whom under heterogeneous TP, and how many notifications each prefill rank waits for.

One logical KV block is ``kv_bytes`` bytes over all heads. Without MLA the
heads are split: prefill rank ``p`` keeps bytes ``[p*kv/P, (p+1)*kv/P)`` of it
and decode rank ``d`` needs ``[d*kv/D, (d+1)*kv/D)``, so a decode rank reads
the overlapping slice from each prefill rank that has part of its range. With
MLA every rank keeps the whole block (replicated), so a decode rank reads one
prefill rank and notifies the others of its group, which MLA let it skip.
A prefill rank is read by ``D/P`` decode ranks when ``D > P`` and expects
that many notifications, else one (vLLM's ``-tp_ratio`` or 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    """Bytes ``[src, src+length)`` of a prefill rank's block go to ``[dst, dst+length)`` of the decode rank's."""

    prefill_rank: int
    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class ReadPlan:
    """A decode rank's READs (one per prefill rank it reads) and the prefill ranks it only notifies."""

    reads: tuple[Slice, ...]
    notify_only: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """Prefill TP, decode TP, MLA or not, and the bytes of one logical block."""

    prefill_tp: int
    decode_tp: int
    mla: bool
    kv_bytes: int

    def __post_init__(self) -> None:
        big, small = max(self.prefill_tp, self.decode_tp), min(self.prefill_tp, self.decode_tp)
        if small < 1 or big % small:
            raise ValueError(
                f"prefill TP {self.prefill_tp} and decode TP {self.decode_tp}: one must divide the other (as in vLLM)"
            )
        if not self.mla and self.kv_bytes % (self.prefill_tp * self.decode_tp):
            raise ValueError(f"kv_bytes {self.kv_bytes} must split evenly over both TP sizes without MLA")

    def block_bytes(self, tp: int) -> int:
        """Bytes of one block on a rank of a side with TP size ``tp``."""
        return self.kv_bytes if self.mla else self.kv_bytes // tp

    def range(self, rank: int, tp: int) -> tuple[int, int]:
        """The logical bytes ``[lo, hi)`` a rank keeps."""
        size = self.block_bytes(tp)
        return (0, size) if self.mla else (rank * size, rank * size + size)

    def group(self, decode_rank: int) -> tuple[int, ...]:
        """The prefill ranks a decode rank is assigned (the first is the one MLA reads)."""
        if self.decode_tp >= self.prefill_tp:
            return (decode_rank // (self.decode_tp // self.prefill_tp),)
        ratio = self.prefill_tp // self.decode_tp
        return tuple(range(decode_rank * ratio, decode_rank * ratio + ratio))

    def plan(self, decode_rank: int) -> ReadPlan:
        if not 0 <= decode_rank < self.decode_tp:
            raise ValueError(f"decode rank {decode_rank} outside 0..{self.decode_tp - 1}")
        group = self.group(decode_rank)
        if self.mla:
            return ReadPlan((Slice(group[0], 0, 0, self.kv_bytes),), group[1:])
        lo, hi = self.range(decode_rank, self.decode_tp)
        reads = []
        for p in group:
            plo, phi = self.range(p, self.prefill_tp)
            a, b = max(lo, plo), min(hi, phi)
            reads.append(Slice(p, a - plo, a - lo, b - a))
        return ReadPlan(tuple(reads), ())

    def expected(self, world_size: int) -> int:
        """Notifications a prefill rank needs for one request, given the world size a notification carries."""
        return world_size // self.prefill_tp if world_size > self.prefill_tp else 1
