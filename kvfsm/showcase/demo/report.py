"""What a demo run returns: one result per part, each judging itself against what kvfsm promises."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ...explore import ExploreResult, Trace
from ..bench.mooncake import SoakResult
from ..sim import SimReport


class PartResult(Protocol):
    """A part's figures; ``ok`` says whether it came out as kvfsm promises."""

    @property
    def name(self) -> str: ...

    @property
    def seconds(self) -> float: ...

    @property
    def ok(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class SpecVerdict:
    """`kvfsm check` of one spec file: a machine spec, or a system file (a composition of roles)."""

    spec: str
    """The file, relative to the parent of the specs directory (``specs/kv_request.yaml``)."""
    kind: str
    """``machine`` or ``system``."""
    errors: int
    warnings: int
    codes: tuple[str, ...]
    """The distinct finding codes, sorted."""
    pre_fix: bool = False
    """A seed's pre-fix shape (``*_pre_fix.yaml``), kept to show that the check rejects it."""

    @property
    def verdict(self) -> str:
        if self.pre_fix:
            return "rejected" if self.errors else "not rejected"
        return "errors" if self.errors else "warnings" if self.warnings else "clean"

    @property
    def as_expected(self) -> bool:
        return bool(self.errors) if self.pre_fix else not self.errors


@dataclass(frozen=True)
class CheckPart:
    """Every spec checked: as expected when there is at least one, none has an error, and every pre-fix one is rejected."""

    specs: tuple[SpecVerdict, ...]
    seconds: float
    name: str = "check"

    @property
    def ok(self) -> bool:
        return bool(self.specs) and all(s.as_expected for s in self.specs)

    def as_dict(self) -> dict[str, Any]:
        return {"specs": [asdict(s) | {"verdict": s.verdict} for s in self.specs]}


@dataclass(frozen=True)
class Drawing:
    """The files drawn for one machine spec; ``error`` says why there are none (the spec cannot be read)."""

    spec: str
    mermaid: str | None = None
    svg: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class DiagramPart:
    """Every machine spec drawn; SVG may be skipped (no graphviz), Mermaid may not."""

    out: str
    drawings: tuple[Drawing, ...]
    svg_skipped: str | None
    """Why no SVG was written (graphviz ``dot`` missing), or None."""
    seconds: float
    name: str = "diagrams"

    @property
    def ok(self) -> bool:
        return bool(self.drawings) and all(d.mermaid and not d.error for d in self.drawings)

    def as_dict(self) -> dict[str, Any]:
        return {"out": self.out, "svg_skipped": self.svg_skipped, "drawings": [asdict(d) for d in self.drawings]}


@dataclass(frozen=True)
class OffloadPart:
    """Seed 003: the vLLM scheduler simulator driving the CPU-offload connector under pressure.

    As expected when the run is clean (no leaked reference, no stale byte, no
    vLLM assertion) and really had preemptions and aborts mid-load.
    """

    report: SimReport
    device: str
    """Where the simulated GPU KV cache lived: ``cuda`` when present, else ``cpu``."""
    seconds: float
    name: str = "offload"

    @property
    def ok(self) -> bool:
        r = self.report
        return r.clean and r.preempted > 0 and r.aborted_mid_load > 0

    def as_dict(self) -> dict[str, Any]:
        r = self.report
        return asdict(r) | {
            "device": self.device,
            "preempted_fraction": r.preempted_fraction,
            "aborted_mid_load_fraction": r.aborted_mid_load_fraction,
            "clean": r.clean,
        }


def _soak_dict(s: SoakResult) -> dict[str, Any]:
    return asdict(s) | {"faults": sum(s.faults_injected.values()), "clean": s.clean}


@dataclass(frozen=True)
class MooncakePart:
    """Seed 000: the Mooncake store worker on the embedded store with injected faults.

    As expected when faults were injected and the kvfsm sender leaked and hung
    nothing, and the pre-fix sender (if run) did leak under the same faults.
    """

    requested: int
    soak: SoakResult
    unfixed: SoakResult | None
    """The same soak with the pre-fix sender (releases on the success path only), cut short when it stalls."""
    seconds: float
    name: str = "mooncake"

    @property
    def soak_ok(self) -> bool:
        """Every request ran, faults were injected, and nothing leaked or hung."""
        s = self.soak
        return s.clean and s.requests == self.requested and sum(s.faults_injected.values()) > 0

    @property
    def unfixed_leaked(self) -> bool | None:
        """Whether the pre-fix sender leaked blocks or hung requests (None: not run)."""
        u = self.unfixed
        return None if u is None else bool(u.leaked_blocks or u.hung_requests)

    @property
    def ok(self) -> bool:
        return self.soak_ok and self.unfixed_leaked is not False

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "kvfsm": _soak_dict(self.soak),
            "pre_fix": _soak_dict(self.unfixed) if self.unfixed is not None else None,
        }


PROPERTY = "write_after_free"
"""The race of seed 002: prefill still writing into KV pages decode has freed."""


@dataclass(frozen=True)
class ExplorePart:
    """Seed 002: the merged fix still has the race (with its trace); the corrected protocol is verified."""

    merged_fix: ExploreResult
    corrected: ExploreResult
    seconds: float
    name: str = "explore"

    @property
    def trace(self) -> Trace | None:
        """The merged fix's shortest ``write_after_free`` counterexample."""
        return next((p.trace for p in self.merged_fix.violated if p.name == PROPERTY), None)

    @property
    def ok(self) -> bool:
        return self.trace is not None and self.corrected.verdict == "verified"

    def as_dict(self) -> dict[str, Any]:
        def summary(r: ExploreResult) -> dict[str, Any]:
            keep = ("system", "path", "verdict", "requests", "states", "transitions", "depth", "seconds", "complete")
            d = r.as_dict()
            return {k: d[k] for k in keep} | {"violated": [p.name for p in r.violated]}

        trace = self.trace
        return {
            "merged_fix": summary(self.merged_fix) | {"trace": trace.as_dict() if trace is not None else None},
            "corrected": summary(self.corrected),
        }


@dataclass(frozen=True)
class FailedPart:
    """A part that raised instead of returning figures (an unwritable output directory, a missing file)."""

    name: str
    error: str
    seconds: float

    @property
    def ok(self) -> bool:
        return False

    def as_dict(self) -> dict[str, Any]:
        return {"error": self.error}


@dataclass(frozen=True)
class DemoReport:
    """Every part that ran, in order; ``ok`` when each came out as expected."""

    parts: tuple[PartResult, ...]
    quick: bool
    seed: int
    seconds: float

    @property
    def ok(self) -> bool:
        return bool(self.parts) and all(p.ok for p in self.parts)

    def part(self, name: str) -> PartResult | None:
        return next((p for p in self.parts if p.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "quick": self.quick,
            "seed": self.seed,
            "seconds": round(self.seconds, 3),
            "parts": {p.name: {"ok": p.ok, "seconds": round(p.seconds, 3)} | p.as_dict() for p in self.parts},
        }
