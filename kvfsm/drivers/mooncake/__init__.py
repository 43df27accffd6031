"""Mooncake store drivers: the store jobs and loads of a Mooncake store connector, run by kvfsm.

- :class:`MooncakeStoreWorker`: a vLLM-shaped worker (sending thread, load
  threads, ``get_finished``) over the three specs ``mooncake_store_request``
  (which owns its store jobs), ``mooncake_store_send`` and ``mooncake_store_load``;
- :class:`StoreRequests` / :class:`StoreSender` / :class:`StoreLoader`: those specs' drivers;
- :func:`connect`: the real ``MooncakeDistributedStore``, set up with bounds;
  :class:`EmbeddedMaster` / :class:`EmbeddedStore`: the in-process stand-in
  (fault injection in front of either, and a real ``mooncake_master`` on
  loopback, are the harness's: :mod:`kvfsm.harness.mooncake`);
- :class:`BlockBuffer`: the blocks of one :class:`~kvfsm.drivers.block_pool.BlockPool`
  as rows of one registered tensor, the staging copy of an engine's own KV
  cache once attached (:meth:`BlockBuffer.attach`);
- :class:`Report` / :class:`Finished`: what vLLM is owed, recorded by the drivers' releases.
"""

from ..block_pool import BlockPool, HolderError
from ..report import Finished, Report
from .buffer import BlockBuffer
from .codes import StoreClosed, StoreError, StoreUnavailable
from .driver import NotHeld, StoreLoader, StoreRequests, StoreSender, block_key
from .embedded import EmbeddedMaster, EmbeddedStore, connect_embedded
from .store import KVStore, MooncakeStore, ObjectStore, connect
from .worker import MooncakeStoreWorker, bundled_spec

__all__ = [
    "BlockBuffer",
    "BlockPool",
    "EmbeddedMaster",
    "EmbeddedStore",
    "Finished",
    "HolderError",
    "KVStore",
    "MooncakeStore",
    "MooncakeStoreWorker",
    "NotHeld",
    "ObjectStore",
    "Report",
    "StoreClosed",
    "StoreError",
    "StoreLoader",
    "StoreRequests",
    "StoreSender",
    "StoreUnavailable",
    "block_key",
    "bundled_spec",
    "connect",
    "connect_embedded",
]
