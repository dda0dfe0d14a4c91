"""The stall rule (pure logic): the channel's end moving on while the read position stands
still is reported after ``after_s``; an idle channel, a reader catching up, a reader held at
its memory bound and a constant one-offset gap (a Kafka transaction marker) are not stalls."""

from __future__ import annotations

import pytest

from icefloe.coordination.stall import StallWatch


def test_a_read_position_left_behind_by_a_moving_end_is_a_stall_after_the_limit() -> None:
    watch = StallWatch(after_s=10)
    assert watch.observe({"0": 5}, {"0": 5}, now=0) is None  # caught up
    assert watch.observe({"0": 5}, {"0": 5}, now=100) is None  # idle for long: no stall
    assert watch.observe({"0": 5}, {"0": 7}, now=101) is None  # the end moved: clock starts
    assert watch.observe({"0": 5}, {"0": 9}, now=110) is None  # 9 s
    assert watch.observe({"0": 5}, {"0": 9}, now=111) == 10
    assert watch.observe({"0": 5}, {"0": 12}, now=131) == 30
    assert watch.observe({"0": 8}, {"0": 12}, now=132) is None  # it reads again


def test_reading_held_back_at_the_memory_bound_is_no_stall() -> None:
    watch = StallWatch(after_s=1)
    watch.observe({"0": 5}, {"0": 5}, now=0)
    watch.observe({"0": 5}, {"0": 9}, now=1)
    assert watch.observe({"0": 5}, {"0": 9}, now=5, held=True) is None
    assert watch.observe({"0": 5}, {"0": 9}, now=50) is None  # the end has not moved since


def test_an_end_standing_one_marker_ahead_for_good_is_no_stall() -> None:
    watch = StallWatch(after_s=1)
    watch.observe({"0": 5, "1": 3}, {"0": 6, "1": 3}, now=0)
    assert watch.observe({"0": 5, "1": 3}, {"0": 6, "1": 3}, now=1000) is None
    # one partition stalls while the other is fine: a stall
    assert watch.observe({"0": 5, "1": 3}, {"0": 6, "1": 4}, now=1001) is None
    assert watch.observe({"0": 5, "1": 3}, {"0": 6, "1": 4}, now=1002) == 1


def test_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="after_s"):
        StallWatch(after_s=0)
