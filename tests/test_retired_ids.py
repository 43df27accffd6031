"""RetiredIds: the lazily indexed memory of drained ids that tells a late message from an unknown one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.engine.retired import RetiredIds

ids = st.integers(min_value=0, max_value=30)
ops = st.lists(
    st.one_of(st.tuples(st.just("add"), st.lists(ids, max_size=6)), st.tuples(st.just("ask"), ids)), max_size=60
)


@settings(max_examples=400, deadline=None)
@given(limit=st.integers(min_value=1, max_value=12), ops=ops)
def test_remembers_exactly_the_kept_lists_whatever_the_order_of_adds_and_lookups(
    limit: int, ops: list[tuple[str, object]]
) -> None:
    retired = RetiredIds(limit)
    kept: list[list[int]] = []  # the plain model: every list, the oldest dropped while the rest still hold `limit`
    for op, arg in ops:
        if op == "add":
            assert isinstance(arg, list)
            retired.add(list(arg))
            if arg:
                kept.append(list(arg))
            while kept and sum(map(len, kept)) - len(kept[0]) >= limit:
                kept.pop(0)
        else:
            assert (arg in retired) == any(arg in batch for batch in kept), (arg, kept)
        newest = [i for batch in kept for i in batch][-limit:]
        assert all(i in retired for i in newest)  # the newest `limit` ids are never forgotten
        assert len(retired) == sum(map(len, kept))


def test_an_unhashable_id_raises_type_error_as_a_dict_lookup_would() -> None:
    retired = RetiredIds(4)
    retired.add(["a"])
    with pytest.raises(TypeError):
        [] in retired  # noqa: B015


def test_a_key_that_finished_twice_in_the_same_final_state_drains_as_two_instances() -> None:
    from kvfsm import Tracker
    from kvfsm.spec import read_text

    spec = read_text(
        "kvfsm: 1\nmachine: twice\nkey: k\nstates:\n  a: {initial: true, waits: local}\n  x: {final: failure}\n"
        "transitions:\n  - {event: fail, from: a, to: x}\n",
        "<twice>",
    )
    t = Tracker(spec, object())
    for _ in range(2):
        t.begin("k")
        t.fire("k", "fail")
    assert t.finished() == [("k", "x"), ("k", "x")]
    assert t.state("k") is None and t.fire("k", "fail") is None
    assert [a.kind for a in t.anomalies()] == ["late"]
