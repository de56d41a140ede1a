"""Which ranks of a group belong to which accelerator type, and how a buffer is split among them.

A *kind* is an accelerator type name (e.g. "H100", "MI300X", "emu-fast"). Ranks of one kind share
a native backend; ranks of different kinds meet on the bridge. Everything here is pure data,
computed identically on every rank, which is what keeps group creation in the same order
everywhere.

Sharding of a flat buffer in a mixed group (used by the hierarchical all-reduce): the buffer is
padded to a multiple of ``units = lcm(kind sizes)`` elements and cut into ``units`` equal chunks.
Member ``j`` of a kind of size ``n`` owns the contiguous chunks ``[j*units/n, (j+1)*units/n)``
after the native reduce-scatter. Cutting the chunk range at every kind's shard boundaries gives
*segments*; each segment has exactly one owner per kind, and those owners (a *channel*) sum the
segment over the bridge. With equal kind sizes the channels are "local rank i of every kind";
with uneven sizes (3+1, 1+1+2) a rank of the smaller kind sits in several channels, which is
correct and still spreads the cross-type traffic over several pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Chunk range ``[start, stop)`` (in units) and its owner in every kind (global ranks)."""

    start: int
    stop: int
    owners: tuple[int, ...]


@dataclass(frozen=True)
class GroupLayout:
    """The ranks of one group, sorted (group rank = position, as in ``dist.new_group``), by kind.

    ``kinds`` lists the kinds present in order of first appearance; ``members[i]`` holds the
    global ranks of ``kinds[i]`` in group order.
    """

    ranks: tuple[int, ...]
    kinds: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, ranks: Sequence[int], rank_kinds: Sequence[str]) -> GroupLayout:
        """Layout of ``ranks`` (global, distinct) given the kind of every global rank."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"group ranks must be distinct, got {list(ranks)}")
        for r in ranks:
            if not 0 <= r < len(rank_kinds):
                raise ValueError(f"rank {r} is outside the world of {len(rank_kinds)} ranks")
        kinds: list[str] = []
        for r in ranks:
            if rank_kinds[r] not in kinds:
                kinds.append(rank_kinds[r])
        members = tuple(tuple(r for r in ranks if rank_kinds[r] == k) for k in kinds)
        return cls(ranks, tuple(kinds), members)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_mixed(self) -> bool:
        """True when the group spans more than one accelerator type."""
        return len(self.kinds) > 1

    @property
    def even(self) -> bool:
        """True when every kind has the same number of ranks in this group."""
        return len({len(m) for m in self.members}) == 1

    @property
    def units(self) -> int:
        """Number of equal chunks a flat buffer is cut into (lcm of the kind sizes)."""
        return math.lcm(*(len(m) for m in self.members))

    def kind_index(self, rank: int) -> int:
        """Index into ``kinds`` of a global rank of this group."""
        for i, m in enumerate(self.members):
            if rank in m:
                return i
        raise ValueError(f"rank {rank} is not in group {list(self.ranks)}")

    def local_index(self, rank: int) -> int:
        """Position of a global rank among the ranks of its kind in this group."""
        return self.members[self.kind_index(rank)].index(rank)

    def group_rank(self, rank: int) -> int:
        """Group rank of a global rank."""
        return self.ranks.index(rank)

    def shard_units(self, rank: int) -> tuple[int, int]:
        """Chunk range ``[start, stop)`` a rank owns after the native reduce-scatter."""
        n = len(self.members[self.kind_index(rank)])
        per = self.units // n
        j = self.local_index(rank)
        return j * per, (j + 1) * per

    def segments(self) -> list[Segment]:
        """The chunk range cut at every kind's shard boundary, with one owner per kind each."""
        units = self.units
        cuts = sorted({j * units // len(m) for m in self.members for j in range(len(m))} | {units})
        segs = []
        for start, stop in zip(cuts[:-1], cuts[1:]):
            owners = tuple(m[start * len(m) // units] for m in self.members)
            segs.append(Segment(start, stop, owners))
        return segs

    def entry_channel(self, local: int) -> tuple[int, ...]:
        """Local rank ``local`` (modulo kind size) of every kind: the broadcast/gather channel."""
        return tuple(m[local % len(m)] for m in self.members)

    def channels(self) -> list[tuple[int, ...]]:
        """Every bridge channel a mixed group needs, deduplicated, in a rank-independent order."""
        if not self.is_mixed:
            return []
        found: list[tuple[int, ...]] = []
        candidates = [s.owners for s in self.segments()]
        candidates += [self.entry_channel(i) for i in range(max(len(m) for m in self.members))]
        for owners in candidates:
            if owners not in found:
                found.append(owners)
        return found
