"""What a load-or-recompute decision is about and what it chose (:mod:`kvcore.load_costs`).

.. versionadded:: 0.3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from kvcore.config import LoadPolicy
from kvcore.read_rate import ReadRate

__all__ = ["LOAD_POLICIES", "PACE_SLOWDOWN", "LoadChoice", "StoredRun", "check_load_policy"]

#: the slowdown a load's pace guards against (a store ten times slower than measured, mid-load)
PACE_SLOWDOWN = 10

#: :data:`LoadPolicy`: ``auto``: load when loading is expected to be faster; ``always``: load
#: whatever is found (kvcore before 0.3); ``never``: recompute everything
LOAD_POLICIES: tuple[str, ...] = get_args(LoadPolicy)


def check_load_policy(value: object, field: str = "load_policy") -> LoadPolicy:
    """``value`` as a :data:`LoadPolicy`, or a ValueError naming ``field``."""
    if value not in LOAD_POLICIES:
        raise ValueError(f"{field} must be one of {', '.join(LOAD_POLICIES)}; got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class StoredRun:
    """``blocks`` consecutive stored blocks of a request, read from a store measured by
    ``rate``; a stack's tiers give one run each, the fastest first."""

    blocks: int
    rate: ReadRate


@dataclass(frozen=True, slots=True)
class LoadChoice:
    """What to load of one request, and what the decider expected of it."""

    #: leading blocks to load (0: recompute everything)
    blocks: int
    #: leading blocks the store holds
    found: int
    #: ``auto``, ``always``, ``never``, ``measuring`` (the store's rate unknown: a load paced
    #: to break even, :attr:`expected_s`), ``bounded`` (the store's rate known only from
    #: smaller reads, whose bound already makes loading faster), ``unproven`` (a probe read
    #: one size of a slow store within its budget, and that bound does not: recompute),
    #: ``uninformed`` (no prefill measured yet: loads),
    #: ``unavailable`` (the store is not open: nothing loads), ``unmeasured`` (the rate is
    #: being measured by another request's load: recompute)
    why: str
    #: expected seconds from now until ``blocks`` are read (0 when none): the wait for loads
    #: chosen before it that share the store included; a ``measuring`` load's break-even pace
    expected_s: float = 0.0
    #: expected seconds to the first token loading ``blocks`` and recomputing ``found``
    #: (None where unknown)
    ttft_load_s: float | None = None
    ttft_recompute_s: float | None = None

    @property
    def paced(self) -> bool:
        """Whether the load should run against :attr:`expected_s` (cut once behind it): the
        loads kvcore chose for their speed (not the ones a policy forced or nothing informed)
        that a store slowing down :data:`PACE_SLOWDOWN` times could make slower than
        recomputing. One that would still be ahead reads at full speed: short spans cost each
        its call's latency (a fast store's load took 0.087 s whole, 0.101 s paced)."""
        if self.blocks <= 0 or self.why not in ("auto", "measuring", "bounded"):
            return False
        if self.ttft_load_s is None or self.ttft_recompute_s is None:
            return True  # (measuring: the pace is the measurement)
        slowed = self.ttft_load_s + (PACE_SLOWDOWN - 1) * self.expected_s
        return slowed >= self.ttft_recompute_s

    @property
    def break_even_s(self) -> float | None:
        """The read time at which this load ties with recomputing (None: unknown, or nothing
        loads): its expected time plus what it is expected to save, never below the expected
        time (a load kept by hysteresis is not cut for running as expected). A ``measuring``
        load has none: its :attr:`expected_s` is its break-even pace already."""
        if self.blocks <= 0 or self.ttft_load_s is None or self.ttft_recompute_s is None:
            return None
        return self.expected_s + max(0.0, self.ttft_recompute_s - self.ttft_load_s)

    @property
    def declined(self) -> int:
        return self.found - self.blocks

    @property
    def saved_s(self) -> float:
        """Expected seconds this choice saves against recomputing (0 where unknown)."""
        if self.blocks == 0 or self.ttft_load_s is None or self.ttft_recompute_s is None:
            return 0.0
        return max(0.0, self.ttft_recompute_s - self.ttft_load_s)
