"""Measure a store's read rate now: a few short reads of stored blocks into scratch memory.

:meth:`kvcore.load_costs.LoadDecider.decide_over` probes a store whose rate is unknown for the
read a decision is about, before deciding.

.. versionadded:: 0.3
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from kvcore.backend import Backend
from kvcore.host_memory import HostBuffer
from kvcore.read_rate import ReadRate
from kvcore.requests import BlockRequest, HostBuffers

__all__ = [
    "PROBE_BUDGET_S",
    "PROBE_BYTES",
    "PROBE_SHARE",
    "ProbeRead",
    "probe_budget_s",
    "probe_first_bytes",
    "probe_read",
    "probe_repeats",
]

#: a probe (:func:`probe_read`) starts no read it expects to end past this long (its first
#: measured read excepted: one size is the least a decision needs)...
PROBE_BUDGET_S = 0.03
#: ...or this many bytes
PROBE_BYTES = 16 << 20
#: a decision looks at the store a second time only while its probe, all its reads together,
#: has spent less than this share of the recompute at stake
#: (:meth:`kvcore.load_costs.LoadDecider.decide_over`): a probe is paid on every decision,
#: the ones that recompute included. Where a 4,000-token prompt recomputes in 0.30 s, the
#: reads of two blocks and then (the second look) four on a 1 Gbit/s link took 25-50 ms to
#: decide to recompute, 8-16 % of it
PROBE_SHARE = 0.05


def probe_budget_s(recompute_s: float | None) -> float:
    """What a decision's probe may spend, all its reads together, a second look included:
    :data:`PROBE_SHARE` of the recompute at stake (:data:`PROBE_BUDGET_S` where that is
    unknown). Its first reads stop at :data:`PROBE_BUDGET_S` whatever this says."""
    if recompute_s is None:
        return PROBE_BUDGET_S
    return PROBE_SHARE * recompute_s


class ProbeRead(NamedTuple):
    """What a probe read: ``blocks`` leading blocks, and whether a read stopped ``short`` (the
    next block is gone, unreadable or failed verification: the run stored ends there, now)."""

    blocks: int
    short: bool = False


def probe_read(
    backend: Backend,
    request: BlockRequest,
    *,
    budget_s: float = PROBE_BUDGET_S,
    max_bytes: int = PROBE_BYTES,
    enough: Callable[[], bool] | None = None,
) -> ProbeRead:
    """Measure ``backend``'s read rate now, before a decision that needs it: read the leading
    blocks of ``request`` (built without buffers) into scratch memory, in reads of 1, 2, 4, ...
    blocks (two sizes tell a store's per-call latency from its bandwidth) until the next read
    would end past ``budget_s`` (one measured read is always made: a client's first read
    measures nothing, and where it read every block there is, they are read again) or
    ``max_bytes`` were read, or, after
    any read, ``enough()`` says what was read decides the question asked
    (:meth:`LoadDecider.needs_probe`), so the reads land in :attr:`kvcore.Backend.read_rate`.
    Returns the blocks read, and whether a read came back short (a fresh client's first reads
    included: a store that fails every read is asked once, never measured); what was read is
    dropped (the engine loads its blocks itself, if it decides to). A backend whose blocks
    have no known size, that does not read host memory, or that was opened for lookups only
    and cannot read then (:attr:`kvcore.Capabilities.lookup_reads` False: its rate comes from
    the process that reads, :meth:`ReadRate.observe`) is not probed (0).
    """
    plan = _probeable(backend, request, max_bytes)
    if plan is None:
        return ProbeRead(0)
    sizes, most = plan
    per_block = sum(sizes)
    with HostBuffer(most * per_block, pinned=False) as scratch:
        base = scratch.ptr
        # a zero-copy client (Mooncake) reads only into memory registered with it
        backend.register_buffer(base, scratch.nbytes)
        try:
            read = _probe_reads(backend, request, base, sizes, most, budget_s, enough)
        finally:
            backend.unregister_buffer(base)
    return read


def probe_repeats(
    backend: Backend,
    request: BlockRequest,
    *,
    budget_s: float = PROBE_BUDGET_S,
    max_bytes: int = PROBE_BYTES,
) -> bool:
    """Whether the one read a probe of ``request`` could start within ``budget_s`` is of a
    size the store was measured at lately, so that it would tell nothing new
    (:meth:`kvcore.estimates.ReadRate.tells_apart`): a slow store whose one-block reads were
    measured (a worker's load of a block took 50 ms at 120 Mbit/s) is not read again to learn
    the same figure, 7 % of recomputing the request each time. :meth:`LoadDecider.decide_over`
    then probes nothing and stands on what was measured (``unproven`` where loading does not
    win at that figure's bound)."""
    first = probe_first_bytes(backend, request, budget_s=budget_s, max_bytes=max_bytes)
    rate = backend.read_rate
    if not first or not rate.known:
        return False  # nothing a probe could read, or nothing measured to repeat
    return not rate.tells_apart(first)


def probe_first_bytes(
    backend: Backend,
    request: BlockRequest,
    *,
    budget_s: float = PROBE_BUDGET_S,
    max_bytes: int = PROBE_BYTES,
) -> int:
    """The bytes of the first read a probe of ``request`` (:func:`probe_read`) would start
    now (0: it reads nothing)."""
    plan = _probeable(backend, request, max_bytes)
    if plan is None:
        return 0
    sizes, most = plan
    per_block = sum(sizes)
    return _first_step(backend.read_rate, per_block, most, budget_s) * per_block


def _probeable(
    backend: Backend, request: BlockRequest, max_bytes: int
) -> tuple[list[int], int] | None:
    """The part sizes of a block and the most blocks a probe of ``request`` reads, or None
    where it reads nothing (see :func:`probe_read`)."""
    sizes = backend.part_sizes(request)
    if (
        not sizes
        or request.num_blocks <= 0
        or backend.capabilities.io != "host"
        or (backend.context.role == "lookup" and not backend.capabilities.lookup_reads)
    ):
        return None
    return sizes, max(1, min(request.num_blocks, max_bytes // max(1, sum(sizes))))


def _first_step(rate: ReadRate, per_block: int, most: int, budget_s: float) -> int:
    """Blocks of a probe's first read: the least that tells more than the reads measured
    lately, but none the rate known says ends past the budget (one block at the least)."""
    step = 1
    while rate.known and not rate.tells_apart(step * per_block) and step * 2 <= most:
        step *= 2
    # ...but no read the rate known already says ends past the budget: a slow store is read
    # one block at a time (at 120 Mbit/s a 2-block read took 0.1 s, 15 % of recomputing)
    while step > 1 and (rate.estimate_s(step * per_block) or 0.0) > budget_s:
        step //= 2
    return step


def _probe_reads(
    backend: Backend,
    request: BlockRequest,
    base: int,
    sizes: list[int],
    most: int,
    budget_s: float,
    enough: Callable[[], bool] | None,
) -> ProbeRead:
    """Reads of 1, 2, 4, ... blocks into ``base`` until the next would end past ``budget_s``
    (as long as the last read measured took, per block), or ``enough()``. Sizes the store was
    measured at lately are skipped: where one block was read before, the first read is of two
    (one more size is what tells latency from bandwidth); where reads of two sizes left its
    bandwidth unseen, one at least twice the largest
    (:meth:`kvcore.estimates.ReadRate.tells_apart`)."""
    per_block = sum(sizes)
    rate = backend.read_rate
    step = _first_step(rate, per_block, most, budget_s)
    read, t0 = 0, time.monotonic()
    last: tuple[int, float] | None = None  # (blocks, seconds) of the last read measured
    cold = rate.cold  # its first read pays for the client's setup and measures nothing
    while read < most:
        n = min(step, most - read)
        if last is not None and time.monotonic() - t0 + last[1] * n / last[0] > budget_s:
            # this read would end past the budget (it reads twice the last one): a decision
            # the reads leave open recomputes (LoadDecider.decide_over), and the next one
            # reads the other size. (Read anyway, a 2x read after one of 26 ms took a 30 ms
            # probe to 78 ms, on a load that then re-read those blocks.)
            break
        ptrs = tuple(
            tuple(base + (read + i) * per_block + sum(sizes[:j]) for j in range(len(sizes)))
            for i in range(n)
        )
        host = HostBuffers(ptrs=ptrs, nbytes=tuple(sizes))
        started = time.monotonic()
        got = int(backend.read(request.slice(read, read + n, host=host)))
        read += got
        if got < n:  # the rest is gone, or the store failed: nothing more to learn now
            return ProbeRead(read, short=True)
        if cold and read >= most:
            # the client's first read measured nothing (its connection) and was all there is
            # to read: those blocks are read once more, measured (one measured read is always
            # made). A fresh engine's first request, often one stored block, then leaves a
            # figure for the next decision where it used to leave none (a worker's first load
            # is no figure either: it pays for that client's setup)
            cold, read, step, t0 = False, 0, n, time.monotonic()
            continue
        cold = False
        if read == got and not rate.known:
            # the client's first read measures nothing (its connection): the budget starts now
            t0 = time.monotonic()
        else:
            last = (n, time.monotonic() - started)
            # past the budget, even after one read: the decision weighs what that one gave
            if time.monotonic() - t0 >= budget_s:
                break
        if enough is not None and enough():
            break
        step *= 2
    return ProbeRead(read)
