"""The MoRIIO control messages, as msgpack structs, parsed with a guard.

vLLM's MoRIIO connector sends msgpack dicts over ZMQ: ``remote_blocks`` (decode
to every prefill rank, WRITE mode), ``write_done`` (prefill to decode, WRITE
mode), ``release`` (decode to prefill: READ mode, reads over; WRITE mode,
the decode side gave up, do not write) and ``released`` (prefill to decode,
WRITE mode: the answer to a ``release``, once nothing of that rank can land
any more). Every one names the
``transfer_id`` both engines agree on, never an engine's own request id.
``prefill`` and the stats pair are the commands of the cross-process test
harness (:mod:`.peer`). :func:`decode` returns None for anything that is not
one of these, so a bad frame is counted, never raised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec


class LayoutPart(msgspec.Struct, array_like=True):
    """One registered tensor's share of every block (:class:`kvfsm.drivers.nixl.memory.Part`): block ``b``'s bytes
    are ``runs`` (offset in the block, length) from ``base + b * stride``."""

    base: int
    stride: int
    runs: list[tuple[int, int]]


class RemoteBlocks(msgspec.Struct, tag="remote_blocks"):
    """Where the decode side's blocks for ``transfer_id`` are: the writer's targets.

    ``layout`` empty: block ``b`` is ``block_bytes`` contiguous bytes at
    ``base + b * block_bytes`` (kvfsm's own blocks). Otherwise the blocks are
    spread as ``layout`` says (vLLM's per-layer cache), ``block_bytes`` in all.
    ``write_by``: wall-clock time (``time.time()``) at which the decode side
    stops waiting and gives the blocks back; a write that could still be in
    flight then must not start (0: no bound).
    """

    transfer_id: str
    peer: str
    base: int
    block_bytes: int
    blocks: list[int]
    decode_rank: int = 0
    layout: list[LayoutPart] = []
    write_by: float = 0.0


class WriteDone(msgspec.Struct, tag="write_done"):
    """Every write of one prefill rank for ``transfer_id`` has landed."""

    transfer_id: str
    rank: int = 0


class Release(msgspec.Struct, tag="release"):
    """READ mode: the decode side's reads of ``transfer_id`` ended (success or failure), free the blocks. WRITE mode:
    the decode request was aborted, write no more and answer ``released`` to ``reply_to`` (empty: nobody waits)."""

    transfer_id: str
    rank: int = 0
    reply_to: str = ""


class Released(msgspec.Struct, tag="released"):
    """WRITE mode: prefill rank ``rank`` writes no more into ``transfer_id``'s blocks (it never began, or drained)."""

    transfer_id: str
    rank: int = 0


class Prefill(msgspec.Struct, tag="prefill"):
    """Compute ``n`` blocks of KV for a request and hold them for ``transfer_id`` (the router's request)."""

    request_id: str
    transfer_id: str
    n: int
    reply_to: str


class StatsQuery(msgspec.Struct, tag="stats_query"):
    """Ask an engine for its counters."""

    reply_to: str


class Stats(msgspec.Struct, tag="stats"):
    """An engine's counters: JSON-able values by name."""

    values: dict[str, object]


class Computed(msgspec.Struct, tag="computed"):
    """The prefill side computed ``transfer_id``'s blocks (READ mode: where the decode side reads them)."""

    transfer_id: str
    peer: str
    base: int
    block_bytes: int
    blocks: list[int]


Message = RemoteBlocks | WriteDone | Release | Released | Prefill | StatsQuery | Stats | Computed

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_all(frames: Iterable[bytes], dropped: Counter[str]) -> list[Message]:
    """The well-formed messages among ``frames``; each malformed one is counted in ``dropped``."""
    out = []
    for frame in frames:
        message = decode(frame)
        if message is None:
            dropped["malformed"] += 1
        else:
            out.append(message)
    return out


def decode(raw: bytes) -> Message | None:
    """The message in ``raw``, or None for anything malformed (never raises)."""
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


FAULTED = (RemoteBlocks, WriteDone, Release)
"""The messages a fault may strike (the harness's ``lost_``/``duplicate_`` faults): the protocol's, not the
harness's own commands."""


def fault_label(raw: bytes) -> tuple[str, str] | None:
    """A message's tag and its ``transfer_id``, the key its fault is decided on: one fault per transfer, whichever
    message of it a fault strikes (:mod:`kvfsm.harness.faults`). None for anything else."""
    message = decode(raw)
    if not isinstance(message, FAULTED):
        return None
    return type(message).__struct_config__.tag, message.transfer_id  # type: ignore[return-value]
