"""Load or recompute: the one decision every engine adapter asks before it loads stored blocks.

A stored block is worth loading only if reading it is faster than computing it. For a request
whose leading run of ``found`` blocks is stored, :meth:`LoadDecider.decide` chooses how many
leading blocks ``k`` to load so that the request's expected time to its first token is least::

    T(k) = wait_link + read(k * block_bytes)  +  prefill(tokens past block k)
    T(0) = wait_engine + prefill(every token past what the engine holds)

- ``read`` comes from the store's :class:`kvcore.estimates.ReadRate`, which the facade
  measures from the reads it serves (per opened backend, so per tier of a stack);
- ``prefill`` from the engine's :class:`kvcore.estimates.PrefillRate`, fed by the adapter
  from its own step timings, with attention's growth in context length;
- ``wait_link`` is the loads this decider already chose that are still reading (they share
  the store), ``wait_engine`` the prefills it chose that are still computing: four requests
  arriving together do not all count on an idle store.

Reading costs the same per block while computing a block costs more the later it lies, so
``T`` is concave in ``k``: the least is at ``k = 0`` or at a run's end (the end of what a faster
tier holds, or ``found``), the only candidates compared. A decision stands unless the other
choice wins by ``margin`` (a fraction), so requests in a row do not flap on noise (the first
informed decision has no side to stand by: it takes the one expected faster). With no
read measured lately (or only reads far smaller than this one:
:meth:`ReadRate.trusted_for`), the load is the measurement (``measuring``): it runs paced to break even
against recomputing what it saves, and is cut as soon as it falls behind that pace. With no
prefill measured yet it loads (kvcore's behaviour before this decision existed), counted as
``uninformed``. (:func:`probe_read` measures a store by a short read where an adapter wants a
figure before any load.)

A load runs against its estimate: :attr:`LoadChoice.expected_s` goes with the load (a
:class:`kvcore.ReadTask`'s ``expected_s``) and a load that falls behind it by more than the
slack is cut, its unread blocks recomputed: a store that slows down mid-load costs about the
estimate, not the slow read.

.. versionadded:: 0.3
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvcore.backend import Backend
from kvcore.config import LoadPolicy
from kvcore.estimates import PrefillRate
from kvcore.load_choice import (
    LOAD_POLICIES,
    PACE_SLOWDOWN,
    LoadChoice,
    StoredRun,
    check_load_policy,
)
from kvcore.load_figures import LoadFigures
from kvcore.load_pace import CUT_GRACE_S, CUT_SLACK, SPAN_S, LoadPace
from kvcore.read_rate import ReadRate
from kvcore.requests import BlockRequest
from kvcore.store_probe import (
    PROBE_BUDGET_S,
    PROBE_BYTES,
    PROBE_SHARE,
    ProbeRead,
    probe_budget_s,
    probe_first_bytes,
    probe_read,
    probe_repeats,
)

__all__ = [
    "CUT_GRACE_S",
    "CUT_SLACK",
    "LOAD_POLICIES",
    "PACE_SLOWDOWN",
    "PROBE_BUDGET_S",
    "PROBE_BYTES",
    "PROBE_SHARE",
    "SPAN_S",
    "LoadChoice",
    "LoadDecider",
    "LoadPace",
    "LoadPolicy",
    "ProbeRead",
    "StoredRun",
    "check_load_policy",
    "probe_budget_s",
    "probe_read",
]


@dataclass(frozen=True, slots=True)
class _Ask:
    """What one decision is about (see :meth:`LoadDecider.decide`)."""

    block_bytes: int
    block_tokens: int
    start_tokens: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class _Timeline:
    """When the store and the engine are free, as a decision sees it at ``now``, and how many
    requests a load would hold up (``delayed``: where loads run inside the engine's step,
    every request whose first token is still due waits for a load chosen now)."""

    now: float
    link_free: float
    engine_free: float
    serial: bool
    delayed: int = 0

    def cost(self, ttft: float, read_s: float) -> float:
        """What loading costs everyone: its own time to first token, plus its read time for
        each request it holds up."""
        return ttft + self.delayed * read_s


def _estimated(rate: ReadRate, nbytes: int) -> float | None:
    """A read's expected seconds, where the rate may be extrapolated that far."""
    return rate.estimate_s(nbytes) if rate.trusted_for(nbytes) else None


def _bounded(rate: ReadRate, nbytes: int) -> float | None:
    """A read's seconds at most (:meth:`ReadRate.bound_s`)."""
    return rate.bound_s(nbytes)


class LoadDecider:
    """The load-or-recompute decision of one engine (one adapter instance). Thread-safe.

    ``prefill``: the engine's :class:`PrefillRate`, which the adapter feeds. ``margin``: how much
    faster the other choice must be expected to be before the decision changes. ``serial``:
    whether loads block the engine's compute (vLLM's synchronous loads run inside the step):
    then the store and the engine are one queue, else two. ``waiting``: where loads are
    serial, how many other requests wait for the engine now (vLLM's waiting queue, less the
    one deciding): a load holds up each of them by its read time, which is added to its cost.
    Four prompts arriving together are decided one by one, and the first, knowing only of
    itself, took a load 10 % faster than its recompute that held the other three up by 0.33 s.
    """

    def __init__(
        self,
        prefill: PrefillRate,
        *,
        policy: LoadPolicy = "auto",
        margin: float = 0.05,
        serial: bool = False,
        waiting: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.prefill = prefill
        self.policy = check_load_policy(policy)
        self.margin = margin
        self.serial = serial
        self._waiting = waiting
        self.figures = LoadFigures()
        #: the decisions' counts (:class:`kvcore.load_figures.LoadFigures`)
        self.counters = self.figures.counters
        self._clock = clock
        self._lock = threading.Lock()
        #: the last informed decision (the hysteresis' side; None before the first: a fresh
        #: engine has no side to stand by, so its first decision takes the faster expected)
        self._loading: bool | None = None
        self._link_free_at = 0.0
        self._engine_free_at = 0.0
        self._due: list[float] = []  # when the first tokens of the requests decided are due

    # -- the decision ----------------------------------------------------------------------

    def needs_probe(
        self,
        runs: Sequence[StoredRun],
        block_bytes: int,
        policy: LoadPolicy | None = None,
        *,
        block_tokens: int = 0,
        start_tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> bool:
        """Whether to measure the first run's store (:func:`probe_read`) before :meth:`decide`:
        ``auto`` only, and only while its rate is unknown for a read this size. Given the
        request (``block_tokens``, ``start_tokens``, ``prompt_tokens``, as :meth:`decide`
        takes them), also not while no prefill rate is known (the decision loads, whatever the
        store's rate: ``uninformed``), and not once the reads measured so far bound the load's
        time below recomputing's (a fast store needs one short read, not a probe's several)."""
        if (policy or self.policy) != "auto" or not runs or runs[0].blocks <= 0:
            return False
        if runs[0].rate.trusted_for(runs[0].blocks * block_bytes):
            return False
        if not block_tokens or prompt_tokens <= start_tokens:
            return True
        recompute = self.prefill.estimate_s(prompt_tokens - start_tokens, start_tokens)
        if recompute is None:
            return False  # nothing to weigh a read against: the decision loads, uninformed
        at = self._timeline(self._clock())
        ask = _Ask(block_bytes, block_tokens, start_tokens, prompt_tokens)
        return self._bounded(runs, ask, at, recompute) is None

    def decide(
        self,
        runs: Sequence[StoredRun],
        *,
        block_bytes: int,
        block_tokens: int,
        start_tokens: int,
        prompt_tokens: int,
        policy: LoadPolicy | None = None,
    ) -> LoadChoice:
        """How many of the stored leading blocks to load.

        ``runs``: the stored blocks from ``start_tokens`` on (the engine holds the tokens
        before it), per store; ``block_bytes``: what one block reads (every rank's share this
        decider's store serves); ``prompt_tokens``: the tokens the request needs computed or
        loaded before its first token.
        """
        found = sum(run.blocks for run in runs)
        chosen = self.policy if policy is None else check_load_policy(policy, "policy")
        if found <= 0:
            return LoadChoice(0, 0, chosen)
        if chosen == "never":
            return self.figures.chosen(LoadChoice(0, found, "never"))
        now = self._clock()
        at = self._timeline(now)
        link_free, engine_free = at.link_free, at.engine_free
        recompute = self.prefill.estimate_s(prompt_tokens - start_tokens, start_tokens)
        ask = _Ask(block_bytes, block_tokens, start_tokens, prompt_tokens)
        options, complete = self._options(runs, ask, at, _estimated)
        informed = recompute is not None and complete
        if chosen == "auto" and not informed and recompute is not None:
            bounded = self._bounded(runs, ask, at, recompute)
            if bounded is not None:
                with self._lock:
                    self._loading = True
                return self._commit(self.figures.chosen(bounded), link_free, engine_free, now)
        if chosen == "auto" and not informed and recompute is not None and options == []:
            # the store's rate is unknown (nothing read lately): load, paced to break even,
            # so the load itself is the measurement: one slower than recomputing what it
            # saves is cut (LoadPace) and its rest recomputed, one faster runs to the end.
            # One measurement at a time: requests arriving while it runs recompute (loads
            # started together would share the store and each look slow)
            if link_free > now:
                choice = LoadChoice(
                    0, found, "unmeasured", 0.0, None, engine_free - now + recompute
                )
                return self._commit(self.figures.chosen(choice), link_free, engine_free, now)
            rest = self.prefill.estimate_s(
                max(1, prompt_tokens - start_tokens - found * block_tokens),
                start_tokens + found * block_tokens,
            )
            if rest is not None and recompute - rest > 0:
                pace = (recompute - rest) / (1 + CUT_SLACK)
                choice = LoadChoice(found, found, "measuring", pace, None, recompute)
                return self._commit(self.figures.chosen(choice), link_free, engine_free, now)
        if chosen == "always" or not informed or recompute is None:
            why = "always" if chosen == "always" else "uninformed"
            expected = options[-1][2] + link_free - now if complete and options else 0.0
            ttft0 = None if recompute is None else engine_free - now + recompute
            choice = LoadChoice(
                found, found, why, expected, options[-1][1] if options else None, ttft0
            )
            return self._commit(self.figures.chosen(choice), link_free, engine_free, now)
        t0 = engine_free - now + recompute
        best_k, best_t, best_read, best_cost = 0, t0, 0.0, t0
        for cand_k, cand_t, cand_read in options:
            if cand_t is not None and at.cost(cand_t, cand_read) < best_cost:
                best_k, best_t, best_read = cand_k, cand_t, cand_read
                best_cost = at.cost(cand_t, cand_read)
        # hysteresis: keep the side taken last unless the other wins by the margin (none taken
        # yet: the faster expected, so a fresh engine's first request is not held to
        # recomputing at a rate where loading is expected faster by less than the margin)
        if best_k and self._loading is False and best_cost > t0 * (1 - self.margin):
            best_k, best_t, best_read = 0, t0, 0.0
        elif not best_k and self._loading and options:
            last_k, last_t, last_read = options[-1]
            if last_t is not None and at.cost(last_t, last_read) <= t0 * (1 + self.margin):
                best_k, best_t, best_read = last_k, last_t, last_read
        with self._lock:
            self._loading = best_k > 0
        choice = LoadChoice(
            best_k,
            found,
            "auto",
            link_free - now + best_read if best_k else 0.0,  # loads booked before share it
            best_t if best_k else (options[-1][1] if options else None),
            t0,
        )
        return self._commit(self.figures.chosen(choice), link_free, engine_free, now)

    def decide_over(
        self,
        backend: Backend,
        found: int,
        *,
        probe: BlockRequest | None = None,
        block_bytes: int,
        block_tokens: int,
        start_tokens: int,
        prompt_tokens: int,
        policy: LoadPolicy | None = None,
    ) -> LoadChoice:
        """:meth:`decide` for ``found`` leading blocks stored in ``backend``, over its measured
        read rate; where that rate is unknown for a read this size and ``probe`` (a request
        for those blocks, built without buffers) is given, the store is measured first
        (:func:`probe_read`: as few reads as it takes for the decision to be informed; counted
        as ``probes`` and ``probe_blocks``), unless the one read it could afford would repeat a
        size measured lately (:func:`probe_repeats`) or could not make loading win even taking
        no time at all (:meth:`_could_win`): counted as ``probes_skipped``, the decision stands
        on what was measured. Every adapter's decision goes through here. The
        seconds it takes, its probe's included, are counted (``deciding_seconds``): they are on
        the request's way to its first token."""
        t0 = time.perf_counter()
        try:
            return self._decide_over(
                backend,
                found,
                probe=probe,
                block_bytes=block_bytes,
                block_tokens=block_tokens,
                start_tokens=start_tokens,
                prompt_tokens=prompt_tokens,
                policy=policy,
            )
        finally:
            self.counters.add("deciding_seconds", time.perf_counter() - t0)

    def _decide_over(
        self,
        backend: Backend,
        found: int,
        *,
        probe: BlockRequest | None,
        block_bytes: int,
        block_tokens: int,
        start_tokens: int,
        prompt_tokens: int,
        policy: LoadPolicy | None,
    ) -> LoadChoice:
        runs = [StoredRun(found, backend.read_rate)]
        stored = found
        ask = {
            "block_tokens": block_tokens,
            "start_tokens": start_tokens,
            "prompt_tokens": prompt_tokens,
        }
        if probe is not None and self.needs_probe(runs, block_bytes, policy, **ask):
            asked = probe if probe.num_blocks <= found else probe.slice(0, found)
            recompute = self.prefill.estimate_s(prompt_tokens - start_tokens, start_tokens)
            probing_since = time.monotonic()  # as the probe times its reads
            # the decision stands on what was measured where the one read a probe could
            # afford would repeat it, or could not make loading win even taking no time
            # (a slow store's one measured block says so: at 490 Mbit/s, 13 ms a block)
            first = probe_first_bytes(backend, asked)
            repeats = probe_repeats(backend, asked) or bool(
                recompute is not None
                and first
                and backend.read_rate.known
                and not self._could_win(runs, block_bytes, ask, recompute, first)
            )
            read, short = 0, False
            if repeats:
                self.counters.add("probes_skipped")
            else:
                read, short = self._probe(
                    backend, asked, runs, block_bytes, policy, ask, PROBE_BUDGET_S
                )

            def unproven() -> bool:
                return bool(
                    (read or repeats)
                    and backend.read_rate.known
                    and recompute is not None
                    and self.needs_probe(runs, block_bytes, policy, **ask)
                )

            # what the whole probe may still spend (its first reads took part of it)
            left = probe_budget_s(recompute) - (time.monotonic() - probing_since)
            if (
                not short
                and recompute is not None
                and (unproven() or self._straddles(runs, block_bytes, ask, recompute))
                and self._second_look_pays(backend, asked, runs, block_bytes, ask, recompute, left)
            ):
                self.counters.add("probes_second_look")
                read, short = self._probe(backend, asked, runs, block_bytes, policy, ask, left)
            if short:
                # the run the lookup saw ends where a read came back short (a block removed
                # since, corrupt, or the store failing): only what was read is worth deciding
                # over, the rest is declined (a counted miss, never a failed load)
                self.counters.add("probe_short")
                found = read
                runs = [StoredRun(found, backend.read_rate)]
            if recompute is not None and unproven():
                # the probe spent its budget on one size (a slow store), or could afford only
                # a size measured already, and its bound does not make loading faster:
                # recompute, unproven (not a load paced to measure: what one read of a slow
                # store took already says loading would likely lose). A probe that measured
                # nothing (the client's first read, then a short one) leaves the rate unknown:
                # decide measures
                now = self._clock()
                with self._lock:
                    engine_free = max(now, self._engine_free_at)
                    link_free = max(now, self._link_free_at)
                choice = LoadChoice(0, stored, "unproven", 0.0, None, engine_free - now + recompute)
                return self._commit(self.figures.chosen(choice), link_free, engine_free, now)
        choice = self.decide(runs, block_bytes=block_bytes, policy=policy, **ask)
        return choice if found == stored else replace(choice, found=stored)

    def _probe(
        self,
        backend: Backend,
        asked: BlockRequest,
        runs: Sequence[StoredRun],
        block_bytes: int,
        policy: LoadPolicy | None,
        ask: dict[str, int],
        budget_s: float,
    ) -> ProbeRead:
        """One :func:`probe_read` of ``asked`` within ``budget_s``, stopped once the decision
        is informed."""
        read = probe_read(
            backend,
            asked,
            budget_s=budget_s,
            enough=lambda: not self.needs_probe(runs, block_bytes, policy, **ask),
        )
        self.counters.add("probes")
        self.counters.add("probe_blocks", read.blocks)
        return read

    def _straddles(
        self, runs: Sequence[StoredRun], block_bytes: int, ask: dict[str, int], recompute: float
    ) -> bool:
        """Whether the probe's reads left the decision inside their own uncertainty: the load
        is far larger than any read measured (the estimate extrapolates), loading wins at the
        estimate but not at the bound (every second measured counted as bandwidth). Reads of
        one and two blocks on a 121 MB/s link fitted 162 to 201 MB/s (a few milliseconds of
        timing noise move the slope of two points that much) and had 124-block loads taken at
        0.53 to 0.60 s that took 0.80 s, against 0.67 s of recomputing; where a third read of
        four blocks was made, the fit said so and the request recomputed."""
        run = runs[0]
        if not run.rate.extrapolates(run.blocks * block_bytes):
            return False
        at = self._timeline(self._clock())
        sized = _Ask(block_bytes, ask["block_tokens"], ask["start_tokens"], ask["prompt_tokens"])
        options, complete = self._options(runs, sized, at, _estimated)
        t0 = at.engine_free - at.now + recompute
        wins = complete and any(
            ttft is not None and at.cost(ttft, read_s) < t0 * (1 - self.margin)
            for _, ttft, read_s in options
        )
        return wins and self._bounded(runs, sized, at, recompute) is None

    def _second_look_pays(
        self,
        backend: Backend,
        asked: BlockRequest,
        runs: Sequence[StoredRun],
        block_bytes: int,
        ask: dict[str, int],
        recompute: float,
        budget_s: float,
    ) -> bool:
        """Whether to read the store once more before recomputing ``unproven`` (or before
        deciding where the reads leave the decision inside their uncertainty,
        :meth:`_straddles`): one read is one sample, and a fast store whose one probe read
        stalled (20 ms for a read of 0.1 ms: a page fault, a scheduler's delay, another
        client's burst) would have a long restore recomputed, 3 s on this machine. Worth it
        only where that read could make loading win
        (even taking no time at all, :meth:`ReadRate.bound_s` ``after_free_read``) and fits in
        what is left of the probe's budget, ``budget_s`` (as long as the reads measured say): a
        slow store, whose next read would take as long as its last, is not read again."""
        first = probe_first_bytes(backend, asked, budget_s=max(0.0, budget_s))
        cost = backend.read_rate.estimate_s(first) if first else None
        if cost is None or cost > budget_s:
            return False
        return self._could_win(runs, block_bytes, ask, recompute, first)

    def _could_win(
        self,
        runs: Sequence[StoredRun],
        block_bytes: int,
        ask: dict[str, int],
        recompute: float,
        first: int,
    ) -> bool:
        """Whether one more read of ``first`` bytes could make loading win by the margin, even
        taking no time at all (:meth:`ReadRate.bound_s` ``after_free_read``): a read that
        could not is not worth making."""
        at = self._timeline(self._clock())
        sized = _Ask(block_bytes, ask["block_tokens"], ask["start_tokens"], ask["prompt_tokens"])
        return (
            self._bounded(
                runs, sized, at, recompute, lambda rate, n: rate.bound_s(n, after_free_read=first)
            )
            is not None
        )

    def _bounded(
        self,
        runs: Sequence[StoredRun],
        ask: _Ask,
        at: _Timeline,
        recompute: float,
        read_of: Callable[[ReadRate, int], float | None] = _bounded,
    ) -> LoadChoice | None:
        """A load that wins even at the stores' bounds (:meth:`ReadRate.bound_s`), or None.

        Reads smaller than this one leave a store's latency and bandwidth confounded, but
        bound its time: a load that wins at that bound by the margin is taken (its
        ``expected_s`` the bound, so it is paced against it) with no more reads to measure."""
        options, whole = self._options(runs, ask, at, read_of)
        t0 = at.engine_free - at.now + recompute
        best = min(
            (o for o in options if o[1] is not None),
            key=lambda o: at.cost(o[1] or 0.0, o[2]),
            default=None,
        )
        if not whole or best is None or at.cost(best[1] or 0.0, best[2]) >= t0 * (1 - self.margin):
            return None
        k, ttft, read_s = best
        found = sum(run.blocks for run in runs)
        return LoadChoice(k, found, "bounded", at.link_free - at.now + read_s, ttft, t0)

    def _options(
        self,
        runs: Sequence[StoredRun],
        ask: _Ask,
        at: _Timeline,
        read_of: Callable[[ReadRate, int], float | None],
    ) -> tuple[list[tuple[int, float | None, float]], bool]:
        """The candidates (0 excluded): (blocks, expected TTFT or None, read seconds) at the
        end of every run, as far as ``read_of`` knows the runs' read times; and whether it
        knew them all."""
        read_s, k = 0.0, 0
        options: list[tuple[int, float | None, float]] = []
        for run in runs:
            if run.blocks <= 0:
                continue
            part = read_of(run.rate, run.blocks * ask.block_bytes)
            if part is None:
                return options, False
            read_s += part
            k += run.blocks
            rest = self.prefill.estimate_s(
                max(1, ask.prompt_tokens - ask.start_tokens - k * ask.block_tokens),
                ask.start_tokens + k * ask.block_tokens,
            )
            if rest is None:
                options.append((k, None, read_s))
                continue
            done = at.link_free + read_s
            ttft = (done if at.serial else max(done, at.engine_free)) + rest - at.now
            options.append((k, ttft, read_s))
        return options, True

    def _timeline(self, now: float) -> _Timeline:
        waiting = self._others_waiting() if self.serial else 0
        with self._lock:
            self._due = [due for due in self._due if due > now]
            return _Timeline(
                now,
                max(now, self._link_free_at),
                max(now, self._engine_free_at),
                self.serial,
                len(self._due) + waiting if self.serial else 0,
            )

    def _others_waiting(self) -> int:
        """The engine's other waiting requests (0 where the adapter cannot tell)."""
        if self._waiting is None:
            return 0
        try:
            return max(0, int(self._waiting()))
        except Exception:  # an engine's internals changed: the decision goes on without them
            return 0

    def _commit(
        self, choice: LoadChoice, link_free: float, engine_free: float, now: float
    ) -> LoadChoice:
        """Book the chosen work on the store's and the engine's queues."""
        with self._lock:
            if choice.blocks:  # expected_s counts from now (a wait for the store included)
                self._link_free_at = max(link_free, now + choice.expected_s)
                if self.serial:
                    self._engine_free_at = self._link_free_at
                    # the load runs in the next step: every first token still due waits for it
                    read_s = max(0.0, choice.expected_s - (link_free - now))
                    self._due = [due + read_s for due in self._due]
            elif choice.ttft_recompute_s is not None:
                self._engine_free_at = now + choice.ttft_recompute_s
                if self.serial:
                    self._link_free_at = self._engine_free_at
            ttft = choice.ttft_load_s if choice.blocks else choice.ttft_recompute_s
            if self.serial and ttft is not None:
                self._due.append(now + ttft)
        return choice

    # -- what happened ---------------------------------------------------------------------

    def settle(self, choice: LoadChoice, actual_s: float, blocks_done: int) -> None:
        """A load chosen by :meth:`decide` ended after ``actual_s`` with ``blocks_done``
        blocks read (fewer than chosen: cut or failed): the estimate against the actual."""
        self.figures.settle(choice, actual_s, blocks_done)

    def cut(self, blocks: int) -> None:
        """A load fell behind its estimate and was cut with ``blocks`` unread (recomputed)."""
        self.figures.cut(blocks)

    def stats(self, rate: ReadRate | None = None) -> dict[str, float]:
        """The decision's counters, the estimates it works from now (``read_*`` of ``rate``,
        ``prefill_*``) and ``load_actual_vs_expected`` (mean over settled loads)."""
        return self.figures.snapshot(self.prefill, rate)
