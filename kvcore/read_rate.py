"""How fast one store delivers reads now: :class:`ReadRate`, measured by the facade from every
read it serves (:attr:`kvcore.Backend.read_rate`), what :class:`kvcore.load_costs.LoadDecider`
weighs a load with. Re-exported by :mod:`kvcore.estimates`, where it was defined until 0.3.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from kvcore.decaying_fit import EXTRAPOLATION, KNOWN_WEIGHT, DecayingFit, bracketed

__all__ = ["STALL", "ReadRate"]

#: a read taking this many times as long as the next read of its size (the same bytes in as
#: many calls: the same work) was a stall (:class:`ReadRate`): far past the spread of one
#: size's reads measured here (one-block probe reads at 4 Gbit/s: 2.8-3.2 ms), well under
#: the 5-6x of the stalls measured
STALL = 3.0

#: how many samples a rate keeps to look for stalls among (its fit keeps all: this is only
#: how far back a stall can be found, a few decisions' probes)
_RECENT = 32


class _Sample(NamedTuple):
    nbytes: int
    calls: int
    seconds: float
    at: float


class ReadRate:
    """How fast one store delivers reads now: ``seconds ≈ bytes / bytes_per_s +
    per_call_s * calls``.

    Fed by :class:`kvcore.Backend` around every read it passes to the backend
    (:meth:`started`/:meth:`finished`); an adapter whose reads run in another process feeds
    what they took with :meth:`observe`. Reads that overlap share the store: what is measured
    is the store's busy time (some read in flight) against the bytes and calls it served, so N
    concurrent reads of B bytes count as N·B bytes in their common time, not as N separate
    rates. A sample is taken whenever the store goes idle, or every ``sample_s`` of continuous
    busy time. The first one of a client's life is not: its first read pays for what the
    client sets up on it (Mooncake's handshake with the segment it reads: 13 ms for a block
    that then reads in 1.3 ms, measured on loopback), which would read as latency and make a
    small probe's bandwidth look several times what the store delivers.

    A stall is discounted: where a size (bytes and calls) was measured once lately and the
    next read of that size takes at most 1/:data:`STALL` of that time, the earlier sample
    leaves the fit (:attr:`stalls_discounted`). A read is only ever slowed by what a stall is
    made of (a page fault, a scheduler's delay, another client's burst), and one stalled
    probe read of a fresh engine (17 ms for a block a 4 Gbit/s link reads in 3 ms, measured)
    otherwise weighed as much as every fast read after it. Only an earlier, slower sample
    goes, and only its size's one: a store that slowed down shows it in every read after,
    which all count.
    """

    def __init__(
        self,
        *,
        half_life_s: float = 60.0,
        sample_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._fit = DecayingFit(2, half_life_s, clock)
        self._lock = threading.Lock()
        self._sample_s = sample_s
        self._in_flight = 0
        self._since = 0.0  # start of the busy time not yet sampled
        self._bytes = 0
        self._calls = 0
        self.samples = 0
        self._half_life_s = half_life_s
        self._largest = (0, 0.0)  # (bytes, when) of the largest sample lately
        self._smallest = (0, 0.0)  # (bytes, when) of the smallest sample lately
        self._cold = True
        #: the samples taken lately, oldest first (what a stall is looked for among)
        self._recent: deque[_Sample] = deque(maxlen=_RECENT)
        #: earlier samples a faster read of their size showed were stalls
        self.stalls_discounted = 0

    @property
    def cold(self) -> bool:
        """No read came back with bytes yet: the first pays for the client's setup, no sample
        here nor where another process is told of it (:meth:`observe`). ``0.3``"""
        with self._lock:
            return self._cold

    def started(self) -> None:
        """A read was handed to the store."""
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1

    def finished(self, nbytes: int) -> None:
        """A read came back with ``nbytes`` bytes (0: nothing read, and nothing learnt of
        the store's rate beyond the time the call took)."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._bytes += nbytes
            self._calls += 1
            now = self._clock()
            busy = now - self._since
            if self._in_flight == 0 or busy >= self._sample_s:
                if self._bytes > 0 and busy > 0 and not self._cold:
                    self._add(self._bytes, self._calls, busy)
                self._cold = self._cold and self._bytes <= 0
                self._bytes = self._calls = 0
                self._since = now

    def observe(self, nbytes: int, seconds: float, calls: int = 1) -> None:
        """A read measured elsewhere: ``nbytes`` in ``seconds`` (never a client's first)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._add(nbytes, calls, seconds)

    def _add(self, nbytes: int, calls: int, seconds: float) -> None:
        now = self._clock()
        alone = self._alone(nbytes, calls, now)
        if alone is not None and alone.seconds >= STALL * seconds:
            self._fit.remove((alone.nbytes, alone.calls), alone.seconds, alone.at)
            self._recent.remove(alone)
            self.stalls_discounted += 1
        self._fit.add((nbytes, calls), seconds)
        self._recent.append(_Sample(nbytes, calls, seconds, now))
        self.samples += 1
        largest, when = self._largest
        if nbytes >= largest or now - when > 2 * self._half_life_s:
            self._largest = (nbytes, now)
        smallest, when = self._smallest
        if smallest == 0 or nbytes <= smallest or now - when > 2 * self._half_life_s:
            self._smallest = (nbytes, now)

    def _alone(self, nbytes: int, calls: int, now: float) -> _Sample | None:
        """The one sample of ``nbytes`` in ``calls`` taken lately, or None (none, or more:
        a size measured twice alike is the store's rate, not a stall)."""
        same = [
            s
            for s in self._recent
            if s.nbytes == nbytes and s.calls == calls and now - s.at <= 2 * self._half_life_s
        ]
        return same[0] if len(same) == 1 else None

    def trusted_for(self, nbytes: int) -> bool:
        """Whether the fit may be extrapolated to a read of ``nbytes``: at most
        :data:`EXTRAPOLATION` times the largest read measured lately, or any size once reads of
        sizes at least twice apart were measured. Reads of one small size confound the store's
        per-call latency with its bandwidth; a rate seen only on them says little of a read a
        hundred times larger."""
        with self._lock:
            largest, when = self._largest
            smallest, _ = self._smallest
            recent = self._clock() - when <= 2 * self._half_life_s
            coef = self._fit.coefficients() if recent else None
        if not recent:
            return False
        if nbytes <= EXTRAPOLATION * largest:
            return True
        # reads of sizes at least twice apart tell latency from bandwidth (then a larger read
        # is the bandwidth's, however large) where bandwidth is a good share of the largest
        # read's time (a third at least): a fit that calls nearly all of it latency rests on a
        # difference of two times of a few milliseconds (a 6 GB/s "bandwidth" from two reads
        # of a 120 MB/s link, measured)
        if largest < 2 * smallest or coef is None:
            return False
        return bool(coef[1] <= 2 * coef[0] * largest)

    def bound_s(self, nbytes: int, *, after_free_read: int = 0) -> float | None:
        """At most how long a read of ``nbytes`` takes at the store's rate now, for a read at
        least as large as every read measured lately (None otherwise, or while unknown).

        Every second of the reads measured is counted as bandwidth: a per-call latency only
        makes a larger read relatively faster, so the bound holds however latency and
        bandwidth share the time, even from reads of one size (which cannot tell them apart,
        :meth:`trusted_for`). A decision that wins even at this bound needs no more reads to
        take. ``after_free_read``: the bound as it would be after one more read of that many
        bytes (one call) that took no time, the lowest that read could bring it (a read that
        could not make a decision win even so is not worth making); where that size was
        measured once lately, without that sample, which such a read would show was a stall.
        """
        with self._lock:
            now = self._clock()
            largest, when = self._largest
            recent = now - when <= 2 * self._half_life_s
            if not recent or nbytes < largest or self._fit.weight < KNOWN_WEIGHT:
                return None
            without: list[tuple[tuple[int, int], float, float]] = []
            alone = self._alone(after_free_read, 1, now) if after_free_read else None
            if alone is not None:
                without.append(((alone.nbytes, alone.calls), alone.seconds, alone.at))
            per_byte = self._fit.slope(0, free=after_free_read, without=without)
        return None if per_byte is None else per_byte * nbytes

    def extrapolates(self, nbytes: int) -> bool:
        """Whether an estimate of a read of ``nbytes`` reaches past :data:`EXTRAPOLATION` times
        the largest read measured lately (then :meth:`estimate_s` lies between the fit and
        :meth:`bound_s`, a range as wide as the reads left latency and bandwidth unsure)."""
        with self._lock:
            largest, when = self._largest
            recent = self._clock() - when <= 2 * self._half_life_s
        return not recent or nbytes > EXTRAPOLATION * largest

    def tells_apart(self, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` would tell more of latency from bandwidth than the
        reads measured lately: one at least twice the smallest or at most half the largest;
        where reads of two such sizes were measured and still left bandwidth unseen (nearly
        all latency, :meth:`trusted_for`), only one at least twice the largest (with nothing
        measured lately, no one read does)."""
        with self._lock:
            largest, when = self._largest
            smallest, _ = self._smallest
            if self._clock() - when > 2 * self._half_life_s or smallest <= 0:
                return False
        if largest >= 2 * smallest:
            return nbytes >= 2 * largest
        return nbytes >= 2 * smallest or 2 * nbytes <= largest

    @property
    def known(self) -> bool:
        """Whether enough was measured lately to estimate from."""
        with self._lock:
            return self._fit.weight >= KNOWN_WEIGHT and self._fit.coefficients() is not None

    def estimate_s(self, nbytes: int, calls: int = 1) -> float | None:
        """Seconds a read of ``nbytes`` (in ``calls`` calls) is expected to take; None unknown.

        A read more than :data:`EXTRAPOLATION` times the largest measured lately (trusted
        that far only because reads of sizes twice apart told latency from bandwidth,
        :meth:`trusted_for`) lies between the fit's extrapolation and :meth:`bound_s` (every
        second measured counted as bandwidth): the estimate is their geometric mean, the
        choice whose worst ratio over the two is least. A bandwidth fitted on reads of one
        and two blocks swings with a few milliseconds of noise: such probes in a fresh vLLM
        engine fitted 162 MB/s on a link delivering 121 MB/s (a 124-block load estimated at
        0.60 s took 0.79 s, against 0.67 s of recomputing), where the bound said 0.79 s; a
        store whose small reads are mostly latency keeps most of the fit's advantage (a
        tenfold gap between the two leaves the estimate a third of the bound)."""
        with self._lock:
            if self._fit.weight < KNOWN_WEIGHT:
                return None
            coef = self._fit.coefficients()
            largest = self._largest[0]
        if coef is None:
            return None
        fitted = float(coef[0] * nbytes + coef[1] * calls)
        if nbytes <= EXTRAPOLATION * largest:
            return fitted
        bound = self.bound_s(nbytes)
        return fitted if bound is None else bracketed(fitted, bound)

    def figures(self) -> dict[str, float]:
        """``bytes_per_s`` and ``per_call_s`` now (empty while unknown)."""
        with self._lock:
            coef = self._fit.coefficients() if self._fit.weight >= KNOWN_WEIGHT else None
        if coef is None:
            return {}
        out = {
            "bytes_per_s": 1.0 / coef[0] if coef[0] > 0 else math.inf,
            "per_call_s": float(coef[1]),
        }
        if self.stalls_discounted:
            out["stalls_discounted"] = float(self.stalls_discounted)
        return out
