"""The store sender as vLLM had it before PR #43742 (seed 000), kept to show what the spec's releases prevent.

The old sending thread gave a job's pin and queue task back at the end of a
successful put and nowhere else. :class:`PreFixSender` is the real
:class:`~kvfsm.drivers.mooncake.driver.StoreSender` with exactly that shape: the spec's releases
(``unpin_blocks``, ``task_done``) do nothing, and ``put_blocks`` releases
both once the put succeeded. Under faults or aborts its requests are never
reported finished and their blocks stay pinned; the model-based tests and
``kvfsm demo`` show it.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..drivers.mooncake.driver import StoreSender


class PreFixSender(StoreSender):
    """:class:`StoreSender` that releases on the success path only (mix it in first to break another sender)."""

    def put_blocks(self, job: Hashable, /) -> None:
        super().put_blocks(job)
        super().unpin_blocks(job)
        super().task_done(job)

    def unpin_blocks(self, job: Hashable, /) -> None:
        """Released in put_blocks, on the success path only."""

    def task_done(self, job: Hashable, /) -> None:
        """Likewise."""
