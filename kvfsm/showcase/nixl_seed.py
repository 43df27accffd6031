"""Seed 004 as a driver: a decode reader that tells the skipped MLA prefill ranks the decode-local id.

vLLM #41974: with MLA and prefill TP > decode TP, ``_read_blocks_for_req``
reads one prefill rank (its READ carries the right id) and sends the others
``f"{req_id}:{world_size}"``, ``req_id`` being the decode side's id, where the
prefill ranks index their held blocks by their own (``meta.remote.request_id``).
This is the correct :class:`~kvfsm.drivers.nixl.BlockReader` with that one
message changed, kept to show what kvfsm makes of it: each skipped rank counts
an ``unknown`` id in its ``request_id`` space and holds the blocks until
``abort_timeout``.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..drivers.nixl.decode import BlockReader, Load
from ..drivers.nixl.notif import encode


class LocalIdReader(BlockReader):
    """Notifies the skipped ranks with the decode-local id: seed 004's shape. Not for use."""

    def skipped_notif(self, key: Hashable, load: Load) -> bytes:
        return encode(str(key), self.topology.decode_tp)  # the bug: key is the decode-local id
