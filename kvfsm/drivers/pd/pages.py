"""KV pages as one torch tensor, filled with a per-room, per-page pattern so every read can be byte-checked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

DTYPE = torch.float16


def pattern(room: int, index: int) -> float:
    """The value page ``index`` of ``room`` holds once its KV is written: an integer ≤ 2040, exact in float16."""
    return float((room * 7919 + index * 104729) % 2039 + 1)


class Pages:
    """``count`` pages of ``elems`` float16 each: in this process, or mapped from a shared file other processes map.

    A shared file is how the embedded backend lets prefill write into
    decode's pages across processes, as an RDMA write would: nothing on that
    path asks whether decode still holds the page.
    """

    def __init__(self, count: int, elems: int, path: str | Path | None = None) -> None:
        self.count = count
        self.elems = elems
        if path:
            flat = torch.from_file(str(path), shared=True, size=count * elems, dtype=DTYPE)
        else:
            flat = torch.zeros(count * elems, dtype=DTYPE)
        self.tensor = flat.view(count, elems)

    @staticmethod
    def create_file(path: str | Path, count: int, elems: int) -> None:
        """Make the zero-filled file a shared :class:`Pages` maps (the coordinator owns and removes it)."""
        with open(path, "wb") as f:
            f.truncate(count * elems * torch.finfo(DTYPE).bits // 8)

    @property
    def page_bytes(self) -> int:
        return self.elems * self.tensor.element_size()

    @property
    def base(self) -> int:
        """The address of page 0 (what a transfer engine registers)."""
        return int(self.tensor.data_ptr())

    def address(self, page: int) -> int:
        return self.base + page * self.page_bytes

    def fill(self, room: int, pages: Sequence[int]) -> None:
        """Write the room's KV (the forward pass, as a known pattern) into ``pages``, page ``i`` with ``pattern(room, i)``."""
        values = torch.tensor([pattern(room, i) for i in range(len(pages))], dtype=DTYPE)
        self.tensor[list(pages)] = values.unsqueeze(1).expand(len(pages), self.elems)

    def wrong(self, room: int, pages: Sequence[int]) -> list[int]:
        """The pages among ``pages`` whose bytes are not what prefill wrote for ``room``."""
        if not pages:
            return []
        expected = torch.tensor([pattern(room, i) for i in range(len(pages))], dtype=DTYPE).unsqueeze(1)
        good = (self.tensor[list(pages)] == expected).all(dim=1).tolist()
        return [p for p, ok in zip(pages, good, strict=True) if not ok]
