"""The story of a model-based run: one readable line per step, and the error that carries it.

A failing example is told as what happened, in the spec's words, with the
broken promise appended to the step that broke it::

    t=0.0 begin req-1 → pinned
    t=0.0 abort req-1: pinned → aborted; observe says gpu_blocks still held
"""

from __future__ import annotations

from collections.abc import Sequence

from .oracle import ExpectedFailure, Expiry, Move, Outcome


def clock(now: float) -> str:
    """``t=3.0``: one decimal when that is exact, else as many as it takes."""
    return f"t={now:.1f}" if round(now, 1) == now else f"t={now:g}"


def _move(move: Move, expired: Sequence[Expiry] = ()) -> str:
    """``expire req-1: retrying → expired``; a phase's deadline adds which phase, when it was entered and the
    moves made inside it since (``expired``: the poll's :attr:`~kvfsm.testing.oracle.Outcome.expired`)."""
    line = f"{move.event} {move.key}: {move.source} → {move.target}"
    if move.phase:
        seen = next((x for x in expired if x.key == move.key and x.phase == move.phase), None)
        if seen is not None:
            return f"{line} (deadline of phase {move.phase}, entered at {clock(seen.entered)}, {seen.moves} move(s) inside since)"
        return f"{line} (deadline of phase {move.phase})"
    return line


def _sent(sender: str) -> str:
    return f" from {sender}" if sender else ""


def _raised(failures: Sequence[ExpectedFailure]) -> str:
    """``alloc() raised (injected fault)``; a link that failed: ``its remote_request_id names another live instance``."""
    return ", ".join(
        f"its {f.action.removeprefix('<link ').removesuffix('>')} names another live instance (not linked)"
        if f.phase == "link"
        else f"{f.action}() raised (injected fault)"
        for f in failures
    )


def _after_faults(outcome: Outcome) -> str:
    """The failures (injected faults that fired, links refused) and the transitions that handled them."""
    raised = _raised(outcome.failures)
    moved = "; ".join(_move(m) for m in outcome.moves)
    if moved and all(f.phase == "link" for f in outcome.failures):
        return f"{moved}; {raised}"
    if moved:
        return f"{raised}, so {moved}"
    return f"{raised}; no on_error transition, state unchanged"


CLOSED = "tracker closed (TrackerClosed, nothing may change)"


def begin_line(key: str, outcome: Outcome) -> str:
    if outcome.refused == "closed":
        return f"begin {key}: {CLOSED}"
    if outcome.refused == "duplicate":
        return f"begin {key}: already live in {outcome.state} (DuplicateKey, nothing may change)"
    if outcome.failures and outcome.moves:
        return f"begin {key} → {outcome.moves[0].target}; {_raised(outcome.failures)}"
    if outcome.failures:
        return f"begin {key}: {_raised(outcome.failures)}; not begun"
    return f"begin {key} → {outcome.moves[0].target}"


def fire_line(key: str, event: str, outcome: Outcome, sender: str = "") -> str:
    """One fire step; ``sender``: who sent an arrival the spec counts (told with the arrival)."""
    if sender:
        line = fire_line(f"{key}{_sent(sender)}", event, outcome)
        if outcome.moves and not outcome.refused and not outcome.failures:
            m = outcome.moves[0]
            line = f"{m.event} {key}{_sent(sender)}: {m.source} → {m.target}"
        return line
    if outcome.refused == "closed":
        return f"{event} {key}: {CLOSED}"
    if outcome.refused == "kept":
        return f"{event} {key}: no such instance yet; kept for when it appears (early)"
    if outcome.refused == "unknown" and outcome.anomaly == "early":
        return f"{event} {key}: no such instance yet, and the early bound is full (an early anomaly, dropped)"
    if outcome.refused == "unknown":
        return f"{event} {key}: no such instance (counted as unknown, not applied)"
    if outcome.refused == "ignored":
        return f"{event} {key}: ignored in {outcome.state}"
    if outcome.refused == "illegal":
        return f"{event} {key}: illegal in {outcome.state} (IllegalTransition, nothing may change)"
    if outcome.refused == "counted" and outcome.anomaly == "duplicate":
        return (
            f"{event} {key}: a repeat from a sender already heard in {outcome.state} (a duplicate anomaly, not counted)"
        )
    if outcome.refused == "counted":
        return f"{event} {key}: counted in {outcome.state}, fewer distinct senders than the count waits for"
    if outcome.failures:
        return f"{event} {key}: {_after_faults(outcome)}"
    return _move(outcome.moves[0])


def deliver_line(event: str, ident: object, space: str, outcome: Outcome, sender: str = "") -> str:
    """``deliver read_done 'r-3' (remote_request_id) → read_done req-1: held → done``, or what the id named."""
    head = f"deliver {event} {ident!r} ({space}){_sent(sender)}"
    if outcome.refused == "kept":
        return f"{head}: names no instance yet; kept for when it appears (early)"
    if outcome.refused == "unknown" and outcome.key is None:
        return f"{head}: {outcome.anomaly} id, names no live instance (counted as {outcome.anomaly}, not applied)"
    return f"{head} → {fire_line(str(outcome.key), event, outcome)}"


def poll_line(dt: float, outcome: Outcome) -> str:
    parts = _moves_and_faults(outcome)
    return f"clock +{dt:g}, poll() → " + ("; ".join(parts) if parts else "nothing due")


def drain_line(outcome: Outcome) -> str:
    if not outcome.drained:
        return "finished() → nothing"
    return "finished() → " + ", ".join(f"{k} {s}" for k, s in outcome.drained)


def close_line(outcome: Outcome, again: bool = False) -> str:
    if again:
        return "close() again → nothing to do"
    parts = _moves_and_faults(outcome)
    parts += [f"{k} released by force (abort cannot finish it)" for k in outcome.forced]
    return "close() → " + ("; ".join(parts) if parts else "nothing live")


def _moves_and_faults(outcome: Outcome) -> list[str]:
    """Each transition in order; an on_error one told after the injected fault that caused it."""
    pending = list(outcome.failures)
    parts = []
    for move in outcome.moves:
        caused = [f for f in pending if f.key == move.key] if move.how == "on_error" else []
        if caused:
            pending = [f for f in pending if f not in caused]
            raised = _raised(caused)
            parts.append(f"{caused[0].event} {move.key}: {raised}, so {_move(move, outcome.expired)}")
        else:
            parts.append(_move(move, outcome.expired))
    parts += [f"{f.event} {f.key}: {_raised([f])}; state unchanged" for f in pending]
    return parts


class SpecViolation(AssertionError):
    """The Tracker or the driver did not do what the spec says.

    ``story`` holds one line per step of the (shrunk) example; the last line
    ends with what went wrong. ``problems`` lists those findings alone;
    ``trace`` the steps as (method, arguments) of :class:`SpecMachine`;
    ``moved`` the transitions each story line made, line by line.
    """

    def __init__(
        self,
        machine: str,
        story: Sequence[str],
        problems: Sequence[str],
        trace: Sequence[tuple[str, tuple[object, ...]]] = (),
        moved: Sequence[tuple[Move, ...]] = (),
    ) -> None:
        self.machine = machine
        self.story = tuple(story)
        self.problems = tuple(problems)
        self.trace = tuple(trace)
        """The steps as (machine method, arguments), to replay the example."""
        self.moved = tuple(moved)
        steps = "\n  ".join(self.story)
        super().__init__(f"the driver diverged from spec {machine!r}:\n  {steps}")
