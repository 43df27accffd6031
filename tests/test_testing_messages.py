"""``kvfsm test`` on counted and early messages: each construct is exercised by construction (a repeated sender
before K distinct ones, a message before its request), so a driver that counts raw messages, one that frees on
the first of K, and one that drops what comes early are each caught by a planned example of the default run.

The spec is NIXL-shaped (``buggy_drivers.READS_SPEC``: ``read`` counted by its readers, and early); the drivers
differ from the correct :class:`~buggy_drivers.ReadHolder` in their ``receive``, the path a notification takes
before the Tracker gets it (:class:`kvfsm.testing.ReceivesMessages`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from buggy_drivers import READS_SPEC, CountsRawReads, DropsEarlyReads, FreesOnFirstRead, ReadHolder
from hypothesis import Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

import kvfsm
from kvfsm.testing import ReceivesMessages, SpecViolation, run, spec_machine
from kvfsm.testing.runner import replay

READS = kvfsm.parse(READS_SPEC, "read_hold.yaml")


def story(report: Any) -> str:
    return "\n".join(report.story) or report.error


def test_the_reads_spec_is_clean() -> None:
    assert kvfsm.spec.run_checks(READS) == []


def test_the_correct_holder_passes_with_counts_and_early_messages_exercised() -> None:
    report = run(READS, ReadHolder, seed=0, examples=20)
    assert report.passed, story(report)
    assert isinstance(ReadHolder(), ReceivesMessages)
    assert {"counted", "duplicate", "kept"} <= set(report.coverage.arrivals)


@pytest.mark.parametrize(
    ("driver", "plan", "last"),
    [
        (
            CountsRawReads,
            "count of read in held (2 distinct senders, a repeated sender)",
            "read req-1 from s0: a repeat from a sender already heard in held (a duplicate anomaly, not counted); "
            "observe says kv_blocks not held by req-1 (req-1 is held, which holds kv_blocks)",
        ),
        (
            FreesOnFirstRead,
            "count of read in held (2 distinct senders, a repeated sender)",
            "read req-1 from s0: counted in held, fewer distinct senders than the count waits for; "
            "observe says kv_blocks not held by req-1 (req-1 is held, which holds kv_blocks)",
        ),
        (
            DropsEarlyReads,
            "early read naming req-1 before its begin",
            "deliver read 'req-1' (request_id) from s0: the driver's receive() dropped it; the spec keeps it until "
            "its id appears (early): a message must reach the Tracker",
        ),
    ],
)
def test_each_message_bug_is_caught_by_a_planned_example_of_the_default_run(
    driver: type[ReadHolder], plan: str, last: str
) -> None:
    report = run(READS, driver, seed=0)
    assert not report.passed and report.found_by == plan, story(report)
    assert report.story[-1].endswith(last), story(report)
    assert report.coverage.examples <= 10


def test_a_raw_count_found_by_random_examples_replays_to_the_same_divergence() -> None:
    """The trace records who sent each arrival and its K, so the story's steps send exactly that again."""
    machine = spec_machine(READS, CountsRawReads)
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(
            seed(0)(machine),
            settings=settings(max_examples=300, database=None, deadline=None, phases=(Phase.generate,)),
        )
    assert any(name == "hear" and len(args) == 5 for name, args in caught.value.trace)
    again = replay(machine, caught.value.trace)
    assert again is not None and again.problems == caught.value.problems


class DropsLateReads(ReadHolder):
    """Drops a notification for a request it has finished: the spec would only ignore it, or count it late."""

    def __init__(self) -> None:
        super().__init__()
        self.done: set[Hashable] = set()

    def free_blocks(self, key: Hashable) -> None:
        super().free_blocks(key)
        self.done.add(key)

    def receive(self, event: str, ident: Hashable, payload: dict[str, Any]) -> bool:
        return ident in self.blocks or ident not in self.done


def test_a_driver_may_drop_what_the_spec_would_refuse_anyway() -> None:
    """It keeps to the spec; what it drops never reaches the Tracker, so the ignore rules for it go unexercised."""
    report = run(READS, DropsLateReads, seed=1, examples=20)
    assert not report.diverged, story(report)
    assert report.verdict is not None and {g.name for g in report.verdict.gaps} <= {
        f"ignored read in {state}" for state in ("read", "expired", "aborted")
    }
