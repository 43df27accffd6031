"""The control messages of the PD protocol, version 1: typed, bounded, and named as the role specs name them.

A message's ``type`` tag is the name the composition
(``specs/pd_abort/*.yaml``) gives it, which is also the event it fires at the
receiving role: ``metadata``, ``abort_req``, ``abort_ack``, ``success``,
``failure``. ``request`` (the router handing a room to prefill), ``hello`` (a
peer's transport address) and ``heartbeat`` are the plumbing around them.
Every field carries its bounds, so the codec refuses what no honest peer
sends before any code sees it.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

VERSION = 1
"""Bumped whenever a message changes shape; a peer speaking another version is dropped, never guessed at."""

MAX_PAGES = 256
"""Most page indices one ``metadata`` names (a room's KV is a few pages; SGLang batches at most 1024)."""

Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
"""The ``room`` id space: SGLang's bootstrap_room, both roles name a request by it."""
Page = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
"""An index into the receiver's page pool; the receiver also checks it against its pool's size."""
PeerName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Every message names its sender; with CURVE on, the listener checks the name against the sender's key."""

    peer: PeerName


class Request(_Message, frozen=True, tag="request"):
    """The router gives prefill a room (SGLang: the request reaches the prefill server)."""

    room: Room


class Metadata(_Message, frozen=True, tag="metadata"):
    """Decode's destination pages for a room, in order (``[room, ip, port, session, dst_kv_indices, ...]``)."""

    room: Room
    pages: Annotated[list[Page], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]


class AbortReq(_Message, frozen=True, tag="abort_req"):
    """Decode gave the room up (``[ABORT, room, decode_ip, decode_port]``)."""

    room: Room


class AbortAck(_Message, frozen=True, tag="abort_ack"):
    """Prefill will write nothing more into the room's pages (``[ABORT_ACK, room]``)."""

    room: Room


class Succeeded(_Message, frozen=True, tag="success"):
    """Every chunk of the room has landed in decode's pages (``[room, KVPoll.Success, prefill_rank]``)."""

    room: Room


class Failed(_Message, frozen=True, tag="failure"):
    """The room failed on prefill and nothing of it is in flight any more (``[room, KVPoll.Failed, ...]``)."""

    room: Room


class Hello(_Message, frozen=True, tag="hello"):
    """Where a peer's pages are: its transport session and the layout a writer needs.

    ``incarnation`` changes when the process restarts, so the receiver can
    tell a restarted peer from a late message of the dead one.
    """

    incarnation: Count
    session: Annotated[str, msgspec.Meta(max_length=256)]
    base: Count
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    pages: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    """Liveness, with the sender's incarnation (a restart shows as a new one)."""

    incarnation: Count
    seq: Count


Message: TypeAlias = Request | Metadata | AbortReq | AbortAck | Succeeded | Failed | Hello | Heartbeat
"""Every message of version 1."""

MESSAGE_TYPES: tuple[type[_Message], ...] = (Request, Metadata, AbortReq, AbortAck, Succeeded, Failed, Hello, Heartbeat)

ROOM_MESSAGES: tuple[type[_Message], ...] = (Request, Metadata, AbortReq, AbortAck, Succeeded, Failed)
"""The messages that name a room: their tag is an event of the receiving role's spec."""


def tag(message: Message) -> str:
    """The message's ``type`` tag: for a room message, the event it is at the receiving role."""
    return str(message.__struct_config__.tag)
