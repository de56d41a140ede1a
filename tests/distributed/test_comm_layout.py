"""Group layout and buffer sharding of the unified communicator (pure code, no processes)."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_het.comm.layout import GroupLayout, Segment


def test_even_types_pair_equal_local_ranks() -> None:
    lay = GroupLayout.build([3, 0, 2, 1], ["a", "a", "b", "b"])
    assert lay.ranks == (0, 1, 2, 3) and lay.kinds == ("a", "b")
    assert lay.members == ((0, 1), (2, 3)) and lay.even and lay.units == 2
    assert lay.segments() == [Segment(0, 1, (0, 2)), Segment(1, 2, (1, 3))]
    assert lay.channels() == [(0, 2), (1, 3)]


def test_three_plus_one_puts_the_lone_rank_in_every_channel() -> None:
    lay = GroupLayout.build(range(4), ["a", "a", "a", "b"])
    assert lay.units == 3 and not lay.even
    assert [s.owners for s in lay.segments()] == [(0, 3), (1, 3), (2, 3)]
    assert lay.shard_units(3) == (0, 3) and lay.shard_units(1) == (1, 2)


def test_two_plus_three_cuts_at_both_kinds_boundaries() -> None:
    lay = GroupLayout.build(range(5), ["a", "a", "b", "b", "b"])
    assert lay.segments() == [
        Segment(0, 2, (0, 2)),
        Segment(2, 3, (0, 3)),
        Segment(3, 4, (1, 3)),
        Segment(4, 6, (1, 4)),
    ]
    # the broadcast entry channels (local rank i of every kind, modulo size) are included
    assert set(lay.channels()) == {(0, 2), (0, 3), (1, 3), (1, 4), (0, 4)}


def test_single_kind_group_has_no_channels() -> None:
    lay = GroupLayout.build([1, 3], ["a", "b", "a", "b"])
    assert not lay.is_mixed and lay.channels() == [] and lay.members == ((1, 3),)


@pytest.mark.parametrize("seed", range(20))
def test_segments_tile_the_buffer_and_owners_hold_them(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(2, 9)
    kinds = [rng.choice("xyz") for _ in range(world)]
    ranks = sorted(rng.sample(range(world), rng.randint(2, world)))
    lay = GroupLayout.build(ranks, kinds)
    segs = lay.segments()
    assert segs[0].start == 0 and segs[-1].stop == lay.units
    for left, right in itertools.pairwise(segs):
        assert left.stop == right.start
    for seg in segs:
        assert len(seg.owners) == len(lay.kinds)
        for kind_members, owner in zip(lay.members, seg.owners):
            assert owner in kind_members
            start, stop = lay.shard_units(owner)
            assert start <= seg.start and seg.stop <= stop
    for owners in lay.channels():
        assert len(set(owners)) == len(owners)


def test_bad_ranks_are_rejected() -> None:
    with pytest.raises(ValueError, match="distinct"):
        GroupLayout.build([0, 0], ["a", "b"])
    with pytest.raises(ValueError, match="outside the world"):
        GroupLayout.build([0, 5], ["a", "b"])
