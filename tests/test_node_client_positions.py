"""What a node's reply may place in a step: only positions the client asked that node for, each once.

``NodeSource`` keeps a reply's rows through ``_asked_once``; a confused or hostile node that repeats a position or
adds one it was not asked for must not put a second (or a foreign) sample into the batch.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from foresight.node.client_replies import asked_once as _asked_once


def expected(pos: list[int], asked: set[int]) -> list[bool]:
    seen: set[int] = set()
    out = []
    for p in pos:
        out.append(p in asked and p not in seen)
        seen.add(p)
    return out


def test_a_repeated_position_keeps_its_first_row_only():
    keep = _asked_once(np.array([3, 5, 3, 3, 7]), np.array([3, 5, 7]))
    assert keep.tolist() == [True, True, False, False, True]


def test_a_position_not_asked_of_this_node_is_dropped():
    keep = _asked_once(np.array([0, 9, 2, 11]), np.array([0, 2, 4]))
    assert keep.tolist() == [True, False, True, False]


def test_an_empty_reply_keeps_nothing():
    assert _asked_once(np.array([], dtype=np.int64), np.array([1, 2])).tolist() == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.sets(st.integers(0, 40), max_size=30))
def test_each_asked_position_kept_once_and_nothing_else(pos, asked):
    keep = _asked_once(np.array(pos, dtype=np.int64), np.array(sorted(asked), dtype=np.int64))
    assert keep.dtype == bool
    assert keep.tolist() == expected(pos, asked)
