"""The coverage bar a model-based run must clear: what it never exercised fails it, unless lowered on purpose.

A run passes only if every edge, deadline and ignore rule of the spec was
exercised, or the user lowered the bar explicitly: ``min_coverage`` (the share
of them that must be exercised) or an exemption list that names each one
left out and says why. An exemption file is YAML, one mapping per machine
(or per system, for a composition's trace set, naming its items)::

    kv_request:
      "transferring --expire--> expired": the deadline is tested against the real store in test_store.py
      "ignored abort in done": abort after done cannot happen in our scheduler
    pd_abort_corrected:
      "message abort_ack": the ACK path is tested against the real bootstrap server
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import KvfsmError
from ..spec.loader import InputError, read_input
from .coverage import Coverage, Gap


class ExemptionError(KvfsmError):
    """An exemption that names nothing the spec has, gives no reason, or a file that is not an exemption list."""


@dataclass(frozen=True)
class Bar:
    """How much of the spec a run must exercise: ``min_coverage`` of it, and everything not in ``exempt``."""

    min_coverage: float = 1.0
    exempt: Mapping[str, str] = field(default_factory=dict)
    """Gap name (see :class:`~kvfsm.testing.coverage.Gap`) → why it may go unexercised."""


@dataclass(frozen=True)
class Verdict:
    """What a run left unexercised, and whether that clears the bar."""

    gaps: tuple[Gap, ...]
    """Never exercised and not exempt."""
    exempted: tuple[tuple[Gap, str], ...]
    """Never exercised, exempt, with the reason given."""
    ratio: float
    """Share of edges, deadlines and ignored pairs exercised."""
    cleared: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "cleared": self.cleared,
            "ratio": round(self.ratio, 4),
            "not_reached": [g.as_dict() for g in self.gaps],
            "exempt": [{**g.as_dict(), "reason": reason} for g, reason in self.exempted],
        }

    def summary(self) -> str:
        """One line: what was not reached and why, or that nothing was missed."""
        if not self.gaps:
            return "every edge, deadline and ignore rule was exercised" + (
                f" ({len(self.exempted)} exempt)" if self.exempted else ""
            )
        return f"{len(self.gaps)} not reached ({self.ratio:.0%} exercised): " + "; ".join(
            f"{g.name} ({g.why})" for g in self.gaps
        )


def judge(coverage: Coverage, bar: Bar, blocked: Mapping[tuple[str, str], str] | None = None) -> Verdict:
    """The verdict on ``coverage``: cleared when nothing unexempt is missing, or the share reaches the bar."""
    check_exemptions(coverage, bar.exempt)
    gaps, exempted = [], []
    for gap in coverage.gaps(blocked):
        if gap.name in bar.exempt:
            exempted.append((gap, bar.exempt[gap.name]))
        else:
            gaps.append(gap)
    ratio = coverage.ratio()
    return Verdict(tuple(gaps), tuple(exempted), ratio, not gaps or ratio >= bar.min_coverage)


def check_exemptions(coverage: Coverage, exempt: Mapping[str, str]) -> None:
    """Refuse an exemption that names nothing in the spec (a typo would silently exempt nothing) or has no reason."""
    check_names(coverage.spec.name, coverage.names(), exempt)


def check_names(machine: str, names: Sequence[str], exempt: Mapping[str, str]) -> None:
    """Refuse an exemption of ``machine`` (a spec or a system) that is not one of ``names`` or gives no reason."""
    for name, reason in exempt.items():
        if name not in names:
            raise ExemptionError(
                f"exemption {name!r} names nothing in machine {machine!r}; it can name: "
                + "; ".join(repr(n) for n in names)
            )
        if not isinstance(reason, str) or not reason.strip():
            raise ExemptionError(
                f"exemption {name!r} of machine {machine!r} gives no reason; say why it may go "
                "unexercised, so the next reader can tell a decision from an oversight"
            )


def load_exemptions(path: str | Path) -> dict[str, dict[str, str]]:
    """Machine name → {gap name: reason}, from an exemption file (see the module docstring).

    The file is read with the spec loader's bound (a device, a FIFO or a file
    over 1 MiB is refused); names and reasons must be plain values.
    """
    try:
        doc = yaml.safe_load(read_input(path, what="exemption file"))
    except InputError as exc:
        raise ExemptionError(f"cannot read exemption file {path}: {exc.problem}; {exc.fix}") from None
    except yaml.YAMLError as exc:
        raise ExemptionError(f"cannot read exemption file {path}: {exc}") from None
    except RecursionError:
        raise ExemptionError(f"cannot read exemption file {path}: its YAML is nested too deeply to read") from None
    example = 'e.g.\n  kv_request:\n    "ignored abort in done": why it may go unexercised'
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ExemptionError(f"{path}: an exemption file maps each machine name to {{name: reason}}; {example}")
    return {_name(machine): {_name(k): _reason(v) for k, v in items.items()} for machine, items in doc.items()}


_PLAIN = (str, int, float, bool)
"""YAML scalars: names and reasons are written as these; a list or mapping (which YAML aliases can make
enormous when printed) is neither."""


def _name(value: object) -> str:
    """A name as text; a list or mapping becomes a name that nothing has, which :func:`check_names` refuses."""
    return str(value) if isinstance(value, _PLAIN) else "<a list or mapping, not a name>"


def _reason(value: object) -> str:
    """A reason as text; anything but a plain value reads as no reason, which :func:`check_names` refuses."""
    return str(value) if isinstance(value, _PLAIN) else ""


__all__ = ["Bar", "ExemptionError", "Verdict", "check_exemptions", "check_names", "judge", "load_exemptions"]
