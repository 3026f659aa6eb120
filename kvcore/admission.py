"""Admission: which offered blocks a capacity-bound store writes at all.

Eviction decides what leaves a full store; admission decides what enters it. On production
traffic most blocks are never read again (in the Mooncake conversation trace, 63 % of block
references are to blocks seen once), so a store that admits every block it is offered spends
most of its writes, and pushes out blocks that would have hit, for blocks nobody reads.

A backend keeps one :class:`AdmissionPolicy`, asks it in its ``kvcore_admit`` hook which
blocks it would store, and tells it of its read hits; kvcore's transfer manager asks before
gathering a write-back, so a refused block costs no copy. Blocks are identified by 64-bit
integers (:func:`block_id` of their keys), so a policy holds no strings.

Policies (:func:`make_policy`):

- ``all``: admit every block (kvcore <= 0.3).
- ``second-hit``: admit a block the second time it is offered. The first offer puts its id
  in the *doorkeeper*, a FIFO of recently offered ids bounded to ``doorkeeper_factor`` times
  the store's capacity in blocks; an id that falls out of it starts again.
- ``adaptive``: runs both, in miniature, on a fixed fraction of the id space chosen by hash
  (``sample_rate``), each with its capacity scaled by that fraction, and follows whichever
  hit more recently (hit counts that halve every few capacities' worth of references). While
  the store has room for a block without evicting anything, it admits it: refusing then
  saves writes but can only lose hits.

All policies are deterministic (no per-process hash seed), thread-safe, and bounded in memory:
:meth:`AdmissionPolicy.state_entries` counts the ids they hold.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Literal

__all__ = [
    "BYTES_PER_ENTRY",
    "MAX_IDS_PER_STRUCTURE",
    "POLICIES",
    "AdaptiveAdmission",
    "AdmissionPolicy",
    "AdmitAll",
    "Doorkeeper",
    "PolicyName",
    "SecondHit",
    "block_id",
    "make_policy",
]

PolicyName = Literal["all", "second-hit", "adaptive"]
POLICIES: tuple[PolicyName, ...] = ("all", "second-hit", "adaptive")

#: bytes one held id costs in CPython 3.11 (an OrderedDict slot, its link and a 64-bit int),
#: measured as resident memory over a million random ids (155; dict tables grow in doublings)
BYTES_PER_ENTRY = 160
#: ids one structure of a policy (a doorkeeper, a miniature cache) holds at most, whatever the
#: store's capacity: a 1 TiB store of small blocks would otherwise size its doorkeeper in
#: billions of ids. A policy's state is at most ``MAX_IDS_PER_STRUCTURE * BYTES_PER_ENTRY``
#: per structure (160 MiB; ``adaptive`` has up to four, the miniatures scaled by their sample)
MAX_IDS_PER_STRUCTURE = 1 << 20

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes the 64-bit integers


def block_id(key: str) -> int:
    """The 64-bit id a policy knows block ``key`` by: the same in every process and run (a
    backend and a simulation of it that use this agree on every decision)."""
    raw = key.encode("utf-8", "surrogatepass")  # any str a key may be, lone surrogates too
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _mix(block_id: int) -> int:
    """A well-spread 64-bit value of ``block_id``: ids that are not hashes (small integers,
    say) still sample evenly."""
    x = (block_id * _GOLDEN) & _MASK64
    return x ^ (x >> 31)


class AdmissionPolicy(ABC):
    """What a store admits (see the module docstring). Subclasses are thread-safe."""

    name: PolicyName
    #: whether decisions depend on which blocks are offered (not only on how many): a store
    #: need not compute :func:`block_id` for a policy that ignores them
    uses_ids: ClassVar[bool] = True

    def __init__(self, capacity_blocks: int) -> None:
        self._lock = threading.Lock()
        self.capacity_blocks = max(1, int(capacity_blocks))
        self.offered = 0  # blocks offered
        self.admitted = 0  # of those, admitted

    def offer(self, block_ids: Sequence[int], room: int = 0) -> int:
        """Blocks offered for writing, in order: how many leading ones to write.

        Every block is recorded as offered, including those after the first refusal (a
        write-back stores a leading run, so they are not written this time). ``room``: how
        many blocks the store holds without evicting anything.
        """
        with self._lock:
            verdicts = self._decide(block_ids, room)
            n = next((k for k, ok in enumerate(verdicts) if not ok), len(verdicts))
            self.offered += len(verdicts)
            self.admitted += n
            return n

    def read(self, block_ids: Sequence[int]) -> None:  # noqa: B027 (most policies ignore it)
        """Blocks found and read: references that hit (they feed adaptive's simulations)."""

    @property
    def uses_reads(self) -> bool:
        """Whether :meth:`read` feeds the policy (it overrides it): a store need not compute
        the ids of blocks read for a policy that ignores them."""
        return type(self).read is not AdmissionPolicy.read

    def resize(self, capacity_blocks: int) -> None:
        """The store's capacity in blocks changed (known once the block size is)."""
        with self._lock:
            self.capacity_blocks = max(1, int(capacity_blocks))
            self._resized()

    def state_entries(self) -> int:
        """Ids the policy holds (its memory is about :data:`BYTES_PER_ENTRY` each)."""
        return 0

    def stats(self) -> dict[str, float]:
        """``admission_*`` figures for a backend's ``kvcore_stats``."""
        with self._lock:
            entries = self.state_entries()
            return {
                "admission_offered": float(self.offered),
                "admission_admitted": float(self.admitted),
                "admission_refused": float(self.offered - self.admitted),
                "admission_state_entries": float(entries),
                "admission_state_bytes": float(entries * BYTES_PER_ENTRY),
                "admission_capacity_blocks": float(self.capacity_blocks),
                **self._more_stats(),
            }

    @abstractmethod
    def _decide(self, block_ids: Sequence[int], room: int) -> list[bool]: ...

    def _resized(self) -> None:  # noqa: B027 (a policy without state sized by capacity)
        """The capacity changed: resize what depends on it."""

    def _more_stats(self) -> dict[str, float]:
        return {}


class AdmitAll(AdmissionPolicy):
    name: PolicyName = "all"
    uses_ids: ClassVar[bool] = False

    def _decide(self, block_ids: Sequence[int], room: int) -> list[bool]:
        return [True] * len(block_ids)


def _bounded(ids: int) -> int:
    """A structure's size in ids, between 1 and :data:`MAX_IDS_PER_STRUCTURE`."""
    return min(max(1, int(ids)), MAX_IDS_PER_STRUCTURE)


class Doorkeeper:
    """The ids offered recently, oldest first, at most ``limit`` of them (not thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = _bounded(limit)
        self._ids: OrderedDict[int, None] = OrderedDict()

    def second_offer(self, block_id: int) -> bool:
        """True if ``block_id`` was offered before (and is forgotten: it is being admitted);
        else remember this offer and return False."""
        ids = self._ids
        if block_id in ids:
            del ids[block_id]
            return True
        ids[block_id] = None
        if len(ids) > self.limit:
            ids.popitem(last=False)
        return False

    def shrink_to(self, limit: int) -> None:
        self.limit = _bounded(limit)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


class SecondHit(AdmissionPolicy):
    """Admit a block the second time it is offered (see the module docstring)."""

    name: PolicyName = "second-hit"

    def __init__(self, capacity_blocks: int, doorkeeper_factor: float = 2.0) -> None:
        super().__init__(capacity_blocks)
        self.doorkeeper_factor = doorkeeper_factor
        self.doorkeeper = Doorkeeper(self._doorkeeper_limit())

    def _doorkeeper_limit(self) -> int:
        return int(self.capacity_blocks * self.doorkeeper_factor)

    def _decide(self, block_ids: Sequence[int], room: int) -> list[bool]:
        second = self.doorkeeper.second_offer
        return [second(b) for b in block_ids]

    def _resized(self) -> None:
        self.doorkeeper.shrink_to(self._doorkeeper_limit())

    def state_entries(self) -> int:
        return len(self.doorkeeper)


class _MiniCache:
    """An LRU cache of sampled ids, with or without a doorkeeper, counting its hits."""

    def __init__(self, capacity: int, doorkeeper: Doorkeeper | None) -> None:
        self.capacity = _bounded(capacity)
        self.doorkeeper = doorkeeper
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.score = 0.0  # hits, decayed

    def reference(self, block_id: int) -> None:
        lru = self.lru
        if block_id in lru:
            lru.move_to_end(block_id)
            self.score += 1.0
            return
        if self.doorkeeper is not None and not self.doorkeeper.second_offer(block_id):
            return
        lru[block_id] = None
        if len(lru) > self.capacity:
            lru.popitem(last=False)

    def resize(self, capacity: int, doorkeeper_limit: int) -> None:
        self.capacity = _bounded(capacity)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
        if self.doorkeeper is not None:
            self.doorkeeper.shrink_to(doorkeeper_limit)

    def __len__(self) -> int:
        return len(self.lru) + (len(self.doorkeeper) if self.doorkeeper is not None else 0)


class AdaptiveAdmission(SecondHit):
    """Follow whichever of ``all`` and ``second-hit`` would have hit more recently, judged by
    miniature simulations of both on a hash-chosen sample of ids (see the module docstring).

    :param sample_rate: fraction of the id space simulated (at least one simulated block of
        capacity is kept, so tiny stores simulate more than this fraction).
    :param half_life: the simulations' hit counts halve every ``half_life`` times their
        capacity in sampled references.
    """

    name: PolicyName = "adaptive"

    def __init__(
        self,
        capacity_blocks: int,
        doorkeeper_factor: float = 2.0,
        sample_rate: float = 1 / 16,
        half_life: float = 4.0,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate {sample_rate} must be in (0, 1]")
        super().__init__(capacity_blocks, doorkeeper_factor)
        self.sample_rate = sample_rate
        self.half_life = half_life
        self._threshold = int(sample_rate * (1 << 64)) - 1
        self._all = _MiniCache(0, None)
        self._second = _MiniCache(0, Doorkeeper(1))
        self._sampled = 0  # sampled references since the last halving
        self.switches = 0
        self.following: PolicyName = "all"
        self._resized()

    def _resized(self) -> None:
        super()._resized()
        mini = max(1, round(self.capacity_blocks * self.sample_rate))
        self._all.resize(mini, 0)
        self._second.resize(mini, int(mini * self.doorkeeper_factor))
        self._period = max(16, int(mini * self.half_life))

    def _sample(self, block_ids: Sequence[int]) -> None:
        """Feed sampled references to both simulations; halve their scores on schedule."""
        threshold = self._threshold
        for b in block_ids:
            if _mix(b) > threshold:
                continue
            self._all.reference(b)
            self._second.reference(b)
            self._sampled += 1
            if self._sampled >= self._period:
                self._sampled = 0
                self._all.score *= 0.5
                self._second.score *= 0.5
        follow: PolicyName = "second-hit" if self._second.score > self._all.score else "all"
        if follow != self.following:
            self.following = follow
            self.switches += 1

    def read(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._sample(block_ids)

    def _decide(self, block_ids: Sequence[int], room: int) -> list[bool]:
        self._sample(block_ids)
        second = self.doorkeeper.second_offer  # kept current whichever is followed
        verdicts = [second(b) for b in block_ids]
        if self.following == "all":
            return [True] * len(block_ids)
        return [ok or k < room for k, ok in enumerate(verdicts)]

    def state_entries(self) -> int:
        return len(self.doorkeeper) + len(self._all) + len(self._second)

    def _more_stats(self) -> dict[str, float]:
        return {
            "admission_following_second_hit": float(self.following == "second-hit"),
            "admission_switches": float(self.switches),
            "admission_sim_score_all": self._all.score,
            "admission_sim_score_second_hit": self._second.score,
        }


def make_policy(
    name: PolicyName,
    capacity_blocks: int,
    *,
    doorkeeper_factor: float = 2.0,
    sample_rate: float = 1 / 16,
) -> AdmissionPolicy:
    """The policy called ``name`` for a store of ``capacity_blocks`` blocks."""
    if name == "all":
        return AdmitAll(capacity_blocks)
    if name == "second-hit":
        return SecondHit(capacity_blocks, doorkeeper_factor)
    if name == "adaptive":
        return AdaptiveAdmission(capacity_blocks, doorkeeper_factor, sample_rate)
    raise ValueError(f"admission policy {name!r} is not one of {', '.join(POLICIES)}")
