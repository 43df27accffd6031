"""Mooncake store return codes, and the errors kvfsm raises when a store call fails.

The store reports failure as negative integers (per call, or per key in batch
calls) rather than exceptions. A driver that treated "not an exception" as
success would report data as stored that never was; :func:`check_codes` turns
every negative code into a :class:`StoreError` naming the call, the keys and
the codes, so the spec's ``on_error`` path runs.
"""

from __future__ import annotations

from collections.abc import Sequence

OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900

NAMES: dict[int, str] = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
"""Names of the codes the Mooncake store returns (mooncake-store/include/types.h)."""


def name(code: int) -> str:
    """``"OBJECT_HAS_LEASE (-706)"`` for a known code, ``"-42"`` otherwise."""
    known = NAMES.get(code)
    return f"{known} ({code})" if known else str(code)


class StoreError(RuntimeError):
    """A store call failed: it raised, or returned a negative code for some keys.

    ``failed`` maps each failed key to its code; ``codes`` is the whole answer.
    """

    def __init__(self, op: str, keys: Sequence[str], codes: Sequence[int], detail: str = "") -> None:
        self.op = op
        self.codes = tuple(codes)
        self.failed = {k: c for k, c in zip(keys, codes, strict=False) if c < 0}
        shown = ", ".join(f"{k}: {name(c)}" for k, c in list(self.failed.items())[:4])
        more = f" and {len(self.failed) - 4} more" if len(self.failed) > 4 else ""
        msg = f"{op} failed for {len(self.failed)} of {len(keys)} key(s): {shown}{more}"
        super().__init__(f"{msg}; {detail}" if detail else msg)


class StoreUnavailable(RuntimeError):
    """No usable store: the master does not answer, or ``setup`` failed or did not return in time."""


class StoreClosed(RuntimeError):
    """A call on a store after ``close()``; the real client would crash the process here."""


def check_codes(op: str, keys: Sequence[str], codes: Sequence[int]) -> list[int]:
    """Return ``codes`` as a list if every one is non-negative, else raise :class:`StoreError`.

    A batch answer of the wrong length is an error too: which key failed would be unknown.
    """
    codes = list(codes)
    if len(codes) != len(keys):
        raise StoreError(
            op, keys, [INTERNAL_ERROR] * len(keys), f"the store answered {len(codes)} codes for {len(keys)} keys"
        )
    if any(c < 0 for c in codes):
        raise StoreError(op, keys, codes)
    return codes
