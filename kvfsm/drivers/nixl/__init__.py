"""NIXL drivers: the KV blocks a prefill rank holds for the decode side's READ, and the decode side's READs.

- :class:`PrefillRank` / :class:`BlockHolder`: ``specs/nixl_prefill.yaml``, blocks
  held per request until every expected notification or the expiry;
- :class:`DecodeRank` / :class:`BlockReader` / :class:`ReadHandles`:
  ``specs/nixl_decode.yaml`` and its owned ``specs/nixl_read.yaml``, READs that
  notify with the prefill's request id, blocks pinned until every READ has
  stopped, byte-checked blocks;
- :class:`Topology`: who reads whom under heterogeneous TP and MLA;
- :class:`BlockLayout` / :class:`CacheBlocks`: where a rank's blocks are (vLLM's
  per-layer KV cache included), and the READ descriptors between two layouts;
- :mod:`.notif`: the ``remote_request_id:world_size`` message, parsed with a guard;
- :class:`Fabric` / :class:`EmbeddedAgent`: the data plane's in-process agents
  (:mod:`kvfsm.drivers.fabric`); ``kvfsm.drivers.nixl.agent.NixlAgent`` the real one
  (imports ``nixl``); the drivers see only :class:`~kvfsm.drivers.dataplane.DataPlane`;
- :mod:`.side_channel`: the handshake across engine processes over pyzmq
  (imports ``zmq``).
"""

from ..dataplane import DataPlane, TransferError, XferState
from ..fabric import EmbeddedAgent, Fabric
from .blocks import KVBlocks, kv_pattern
from .decode import (
    REMOTE_ID,
    BlockMismatch,
    BlockReader,
    DecodeRank,
    Load,
    PeerInfo,
    ReadHandles,
    decode_spec,
    read_spec,
)
from .memory import BlockLayout, BlockMemory, CacheBlocks
from .notif import Notif, encode, parse
from .prefill import BlockHolder, PrefillRank, prefill_spec
from .topology import ReadPlan, Slice, Topology

__all__ = [
    "REMOTE_ID",
    "BlockHolder",
    "BlockLayout",
    "BlockMemory",
    "BlockMismatch",
    "BlockReader",
    "CacheBlocks",
    "DataPlane",
    "DecodeRank",
    "EmbeddedAgent",
    "Fabric",
    "KVBlocks",
    "Load",
    "Notif",
    "PeerInfo",
    "PrefillRank",
    "ReadHandles",
    "ReadPlan",
    "Slice",
    "Topology",
    "TransferError",
    "XferState",
    "decode_spec",
    "encode",
    "kv_pattern",
    "parse",
    "prefill_spec",
    "read_spec",
]
