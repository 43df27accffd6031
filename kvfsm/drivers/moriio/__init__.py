"""MoRIIO drivers (vLLM's MoRIIO connector, seed 001): WRITE and READ mode, prefill and decode side.

- :class:`PrefillEngine` with :class:`BlockWriter` (``specs/moriio/write_producer.yaml``:
  write tasks deferred until ``remote_blocks``, every wait under a deadline, every
  end frees the blocks) or :class:`BlockLender` (``read_producer.yaml``: blocks held
  until every ``release``, reaped at ``defer_timeout``);
- :class:`DecodeEngine` with :class:`WriteReceiver` (``write_consumer.yaml``) or
  :class:`BlockReader` (``read_consumer.yaml``: ``release`` on every outcome);
- :class:`PlaneTransport`: the operations vLLM's ``moriio_engine.py`` uses, over any
  data-plane agent: the embedded one of :class:`Fabric`, a real
  ``kvfsm.drivers.nixl.agent.NixlAgent`` (imports ``nixl``) or
  ``kvfsm.drivers.mooncake.agent.MooncakeAgent`` (imports ``mooncake`` and ``zmq``).
"""

from ..dataplane import TransferError
from ..fabric import Fabric
from .consumer import BlockLoader, BlockMismatch, BlockReader, DecodeEngine, Source, WriteReceiver
from .messages import Message, Release, Released, RemoteBlocks, WriteDone, decode, encode
from .plane import PlaneTransport, Status
from .producer import BlockHolder, BlockLender, BlockWriter, PrefillEngine, expected_acks
from .specs import TRANSFER_ID, moriio_spec

__all__ = [
    "TRANSFER_ID",
    "BlockHolder",
    "BlockLender",
    "BlockLoader",
    "BlockMismatch",
    "BlockReader",
    "BlockWriter",
    "DecodeEngine",
    "Fabric",
    "Message",
    "PlaneTransport",
    "PrefillEngine",
    "Release",
    "Released",
    "RemoteBlocks",
    "Source",
    "Status",
    "TransferError",
    "WriteDone",
    "WriteReceiver",
    "decode",
    "encode",
    "expected_acks",
    "moriio_spec",
]
