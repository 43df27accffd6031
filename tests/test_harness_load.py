"""The one closed loop the transfer drivers' soaks and demos run, on toy systems whose answers are known."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import pytest

from kvfsm.harness.load import Loop, closed_loop
from kvfsm.testing import VirtualClock


class Toy:
    """Requests that end ``after`` steps from their opening; ``ends`` False: none ever ends."""

    def __init__(self, after: int, ends: bool = True, pause: float = 0.0) -> None:
        self.after, self.ends, self.pause = after, ends, pause
        self.age: dict[Hashable, int] = {}
        self.most = 0

    def start(self, indices: range) -> list[Hashable]:
        keys: list[Hashable] = [f"r{i}" for i in indices]
        self.age.update(dict.fromkeys(keys, 0))
        self.most = max(self.most, len(self.age))
        return keys

    def step(self) -> list[Hashable]:
        time.sleep(self.pause)
        for key in self.age:
            self.age[key] += 1
        done = [k for k, a in self.age.items() if self.ends and a >= self.after]
        for key in done:
            del self.age[key]
        return done


@pytest.mark.parametrize(("requests", "concurrency"), [(1, 1), (50, 7), (200, 64), (10, 100)])
def test_every_request_ends_and_no_more_than_concurrency_are_ever_open(requests: int, concurrency: int) -> None:
    toy = Toy(after=3)
    loop = closed_loop(requests, concurrency, start=toy.start, step=toy.step, deadline=10.0)
    assert loop.opened == loop.ended == requests and loop.still_open == [] and loop.late == 0
    assert toy.most == min(requests, concurrency) and len(loop.latencies) == requests


def test_requests_that_never_end_are_reported_open_when_the_loop_gives_up() -> None:
    toy = Toy(after=1, ends=False)
    loop = closed_loop(20, 8, start=toy.start, step=toy.step, deadline=0.01, give_up=0.2)
    assert loop.opened == 8 and loop.ended == 0 and sorted(loop.still_open) == sorted(f"r{i}" for i in range(8))
    assert 0.2 <= loop.wall < 5.0


def test_a_request_ended_after_a_step_that_began_past_its_deadline_is_late() -> None:
    toy = Toy(after=3, pause=0.02)  # each request ends three steps of 20 ms after it opened
    loop = closed_loop(4, 4, start=toy.start, step=toy.step, deadline=0.01, give_up=5.0)
    assert loop.ended == 4 and loop.late == 4
    toy = Toy(after=3, pause=0.02)
    on_time = closed_loop(4, 4, start=toy.start, step=toy.step, deadline=10.0)
    assert on_time.ended == 4 and on_time.late == 0


def test_the_loop_waits_for_the_far_side_to_be_idle_but_not_past_settle() -> None:
    toy = Toy(after=1)
    looks: list[float] = []

    def idle() -> bool:
        looks.append(time.monotonic())
        return len(looks) >= 3

    loop = closed_loop(5, 5, start=toy.start, step=toy.step, deadline=1.0, settle=5.0, idle=idle)
    assert loop.ended == 5 and len(looks) == 3
    toy = Toy(after=1)
    never = closed_loop(5, 5, start=toy.start, step=toy.step, deadline=1.0, settle=0.1, idle=lambda: False)
    assert never.ended == 5 and 0.1 <= never.wall < 2.0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        closed_loop(0, 1, start=Toy(1).start, step=Toy(1).step, deadline=1.0)


def test_a_stall_bound_stops_a_hang_but_not_a_long_run_on_a_virtual_clock() -> None:
    clock = VirtualClock()

    def ticking(toy: Toy) -> Callable[[], list[Hashable]]:
        def step() -> list[Hashable]:
            clock.advance(1.0)  # a step is a second: 300 requests take far longer than the stall bound
            return toy.step()

        return step

    toy = Toy(after=2)
    long = closed_loop(300, 4, start=toy.start, step=ticking(toy), deadline=100.0, stall=5.0, clock=clock)
    assert long.ended == 300 and long.wall > 100.0 and long.late == 0
    hang = Toy(after=2, ends=False)
    stuck = closed_loop(
        300, 4, start=hang.start, step=ticking(hang), deadline=1.0, stall=5.0, clock=clock, wait=clock.advance
    )
    assert stuck.ended == 0 and len(stuck.still_open) == 4 and 5.0 < stuck.wall <= 7.0


def test_on_a_virtual_clock_late_is_exact_however_slow_the_machine() -> None:
    def run(after: int) -> Loop:
        clock = VirtualClock()
        toy = Toy(after=after, pause=0.01)  # real time passes; the loop reads only the virtual clock

        def step() -> list[Hashable]:
            clock.advance(0.5)
            return toy.step()

        return closed_loop(8, 8, start=toy.start, step=step, deadline=1.0, clock=clock)

    # Steps begin at 0, 0.5, 1.0, ...: a request is late once a step before the one that ended it began past 1.0.
    assert [(loop.ended, loop.late, loop.latencies[0]) for loop in map(run, (3, 4, 5))] == [
        (8, 0, 1.5),
        (8, 0, 2.0),
        (8, 8, 2.5),
    ]
