"""Admission policies (kvcore.admission) and the core's door for them (kvcore_admit): exact hit
counts on hand-made traces, the memory bounds, and what a write-back does with a refusal."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from kv_file.model import StoreModel
from memory_backend import MemoryBackend

import kvcore
from kvcore import hookimpl
from kvcore.admission import (
    BYTES_PER_ENTRY,
    MAX_IDS_PER_STRUCTURE,
    AdaptiveAdmission,
    AdmitAll,
    Doorkeeper,
    SecondHit,
    block_id,
    make_policy,
)
from kvcore.transfer import DeviceCache, TransferManager

# Two hot blocks (A, B) between one-off scans, served by a store of 2 blocks, one block a
# request (so prefix hits are plain hits).
HOT_AND_SCANS = ["A", "B", "A", "X1", "A", "B", "X2", "A", "B", "X3", "A", "B", "X4", "A", "B"]


def serve_all(model: StoreModel, names: list[str]) -> tuple[int, str]:
    """Serve one-block requests; returns (hits, per request: H hit, w written, - refused)."""
    ids = {n: block_id(n) for n in names}
    marks = []
    for name in names:
        hits, written, refused = model.serve([ids[name]])
        marks.append("H" if hits else "w" if written else "-")
        assert hits + written + refused == 1
    return marks.count("H"), " ".join(marks)


def test_all_is_lru_admitting_everything() -> None:
    # LRU of 2: A hits twice (requests 3 and 5) until B and the scans push it out for good
    hits, marks = serve_all(StoreModel(2, "all"), HOT_AND_SCANS)
    assert marks == "w w H w H w w w w w w w w w w"
    assert hits == 2


def test_second_hit_stores_a_block_the_second_time_it_is_offered() -> None:
    # A and B are refused once, then stored; every scan block is refused (offered once), so
    # the hot pair stays: A hits from request 5, B from request 9
    model = StoreModel(2, "second-hit")
    hits, marks = serve_all(model, HOT_AND_SCANS)
    assert marks == "- - w - H w - H H - H H - H H"
    assert hits == 7
    assert model.policy.stats()["admission_refused"] == 6  # A and B once, the four scans


def test_adaptive_follows_the_policy_that_hit_more_recently() -> None:
    # Sampling every id (rate 1), without halving (a long half-life), the simulations are
    # exactly `all` and `second-hit` at the store's capacity. While the store has room,
    # everything is admitted. `all` leads first (its simulation hits A at requests 3 and 5);
    # at request 9 `second-hit`'s simulation hits B, its third hit against two: from then on
    # the store follows it. B was admitted at request 6 (under `all`), which took it out of
    # the doorkeeper, so request 9 is B's first offer again: refused; request 12 stores it.
    policy = AdaptiveAdmission(2, sample_rate=1.0, half_life=1000)
    model = StoreModel(2, policy)
    ids = {n: block_id(n) for n in HOT_AND_SCANS}
    following = []
    marks = []
    for name in HOT_AND_SCANS:
        hits, written, _ = model.serve([ids[name]])
        marks.append("H" if hits else "w" if written else "-")
        following.append(policy.following)
    assert " ".join(marks) == "w w H w H w w w - - H w - H H"
    assert following.index("second-hit") == 8  # request 9
    assert set(following[8:]) == {"second-hit"}
    assert marks.count("H") == 5
    stats = policy.stats()
    assert stats["admission_switches"] == 1 and stats["admission_following_second_hit"] == 1


def test_a_policy_blind_to_ids_decides_by_count_and_only_adaptive_uses_reads() -> None:
    """What a store may skip: the ids of a policy without ``uses_ids`` (its verdicts depend on
    the count offered alone) and the reads of one that does not override ``read``."""
    for policy_class in (AdmitAll, SecondHit, AdaptiveAdmission):
        if not policy_class.uses_ids:
            a, b = policy_class(8), policy_class(8)
            for ids in ([1, 2, 3], [1, 1, 1], [7, 8], [9] * 20):
                assert a.offer(ids, 0) == b.offer([0] * len(ids), 0)
    assert [p(8).uses_reads for p in (AdmitAll, SecondHit, AdaptiveAdmission)] == [
        False,
        False,
        True,
    ]


def test_offer_answers_a_leading_run_and_counts_every_block() -> None:
    policy = SecondHit(10)
    a, b, c = block_id("a"), block_id("b"), block_id("c")
    assert policy.offer([a]) == 0  # first offer
    assert policy.offer([a, b, c]) == 1  # a admitted; b refused ends the run; c still seen
    assert policy.offer([c]) == 1  # c's second offer
    stats = policy.stats()
    assert (stats["admission_offered"], stats["admission_admitted"]) == (5, 2)
    assert AdmitAll(1).offer([a, b, c]) == 3


def test_doorkeeper_is_bounded_and_forgets_the_oldest() -> None:
    door = Doorkeeper(100)
    for i in range(10_000):
        assert not door.second_offer(i)
        assert len(door) <= 100
    assert not door.second_offer(0)  # pushed out long ago: a first offer again
    assert door.second_offer(9_999)  # recent: its second offer
    door.shrink_to(10)
    assert len(door) == 10


def test_policies_memory_stays_bounded_whatever_the_traffic() -> None:
    capacity = 1000
    second = SecondHit(capacity, doorkeeper_factor=2.0)
    adaptive = AdaptiveAdmission(capacity, doorkeeper_factor=2.0, sample_rate=1 / 16)
    rng = np.random.default_rng(0)
    for _ in range(50):  # 200,000 offers and reads of 100,000 distinct ids
        ids = rng.integers(0, 100_000, 2000).tolist()
        second.offer(ids)
        adaptive.offer(ids[:1000])
        adaptive.read(ids[1000:])
    assert second.state_entries() <= 2 * capacity
    # the doorkeeper, plus the two simulations of capacity/16 blocks (one with its own
    # doorkeeper of twice that)
    mini = round(capacity / 16)
    assert adaptive.state_entries() <= 2 * capacity + mini + mini + 2 * mini
    stats = adaptive.stats()
    assert stats["admission_state_bytes"] == stats["admission_state_entries"] * BYTES_PER_ENTRY


def test_a_huge_stores_admission_state_is_bounded_by_a_figure_that_holds_in_rss() -> None:
    """Issue 36 #8: the state was ~174 B per id against the 100 B its figure assumed, and a
    1 TiB store at doorkeeper 64 was bounded at ~3.9e9 ids on paper. Now each structure holds
    at most MAX_IDS_PER_STRUCTURE ids, and the reported bytes are at least the RSS they take."""

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    capacity_blocks = (1 << 40) // (16 << 10)  # 1 TiB of 16 KiB blocks
    policy = SecondHit(capacity_blocks, doorkeeper_factor=64)
    rng = np.random.default_rng(7)
    before = rss()
    for _ in range(12):
        policy.offer(rng.integers(0, 2**63, 100_000, dtype=np.int64).tolist())
    grown = rss() - before
    assert policy.state_entries() == MAX_IDS_PER_STRUCTURE
    stated = policy.stats()["admission_state_bytes"]
    assert stated == MAX_IDS_PER_STRUCTURE * BYTES_PER_ENTRY
    assert grown <= stated * 1.1, f"{grown / 2**20:.0f} MiB resident for {stated / 2**20:.0f}"


def test_the_sample_is_a_fixed_fraction_of_the_id_space() -> None:
    policy = AdaptiveAdmission(1 << 20, sample_rate=1 / 16, half_life=1e9)
    ids = [block_id(f"key-{i}") for i in range(64_000)]
    policy.read(ids)
    sampled = len(policy._all.lru)  # each sampled id is referenced once: one entry each
    assert 64_000 / 16 * 0.9 < sampled < 64_000 / 16 * 1.1
    small = AdaptiveAdmission(1 << 20, sample_rate=1 / 16, half_life=1e9)
    small.read(list(range(64_000)))  # ids that are not hashes sample as evenly
    assert 64_000 / 16 * 0.9 < len(small._all.lru) < 64_000 / 16 * 1.1


def test_block_ids_are_the_same_in_every_process() -> None:
    code = "from kvcore.admission import block_id; print(block_id('trace-1f'))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert seen == {str(block_id("trace-1f"))}


def test_make_policy_names_the_choices() -> None:
    assert make_policy("adaptive", 10).name == "adaptive"
    with pytest.raises(ValueError, match="'lfu' is not one of all, second-hit, adaptive"):
        make_policy("lfu", 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sample_rate"):
        AdaptiveAdmission(10, sample_rate=0)


# -- the core's door: a write-back asks before it gathers ----------------------------------

LAYOUT = kvcore.CacheLayout(
    num_layers=2, num_heads=1, block_size=4, head_dim=8, dtype="float32", num_blocks=8
)


class _Refusing(MemoryBackend):
    """Admits the first ``admit_first`` blocks of any offer; counts what it is asked."""

    admit_first = 2
    fail = False
    asked: list[int] = []

    @hookimpl
    def kvcore_admit(self, request):
        type(self).asked.append(request.num_blocks)
        if self.fail:
            raise ConnectionError("admission service unreachable")
        return min(self.admit_first, request.num_blocks)


def _manager() -> tuple[TransferManager, kvcore.Backend]:
    caches = [
        [np.full(LAYOUT.kv_shape, i, dtype=np.float32) for i in range(LAYOUT.num_layers)]
        for _ in range(2)
    ]
    backend = kvcore.open_backend(_Refusing, context={"layout": LAYOUT}, verify_blocks="never")
    tm = TransferManager(
        {"layout": LAYOUT, "max_model_len": 32, "storage_io": "staged", "verify_blocks": "never"},
        DeviceCache(LAYOUT, *caches),
        backend,
    )
    return tm, backend


def test_refused_blocks_are_never_gathered_nor_written() -> None:
    _Refusing.asked, _Refusing.fail = [], False
    tm, backend = _manager()
    try:
        keys = [f"k{i}" for i in range(5)]
        first = tm.write_back({"task_id": "w1", "keys": keys, "device_block_ids": [0, 1, 2, 3, 4]})
        result = first.result()
        # a refusal is not a failure: the write did all it was to do, and says what it refused
        assert (result.num_blocks, result.refused_blocks, result.outcome) == (2, 3, "complete")
        assert result.ok and result.error is None
        assert backend.stats()["blocks.write"] == 2  # the refused three never reached write
        assert result.bytes == 2 * LAYOUT.block_bytes
        # the stored two are skipped; the offer is the three after them
        again = tm.write_back({"task_id": "w2", "keys": keys, "device_block_ids": [0, 1, 2, 3, 4]})
        result = again.result()
        assert (result.skipped_blocks, result.num_blocks, result.refused_blocks) == (2, 2, 1)
        assert _Refusing.asked == [5, 3]
        assert tm.stats()["blocks_refused.write"] == 4
    finally:
        tm.close()
        backend.close()


def test_a_failing_admission_admits_everything_and_is_counted() -> None:
    _Refusing.asked, _Refusing.fail = [], True
    tm, backend = _manager()
    try:
        result = tm.write_back(
            {"task_id": "w", "keys": ["a", "b", "c"], "device_block_ids": [0, 1, 2]}
        ).result()
        assert (result.num_blocks, result.refused_blocks, result.outcome) == (3, 0, "complete")
        assert backend.stats()["errors.admit"] == 1
    finally:
        _Refusing.fail = False
        tm.close()
        backend.close()


def test_backends_without_the_hook_admit_everything() -> None:
    backend = kvcore.open_backend(MemoryBackend, context={"layout": LAYOUT})
    try:
        assert backend.admit(backend.request("t", ["a", "b", "c"])) == 3
    finally:
        backend.close()


def test_a_write_that_asks_admission_writes_the_admitted_run_and_says_what_it_refused() -> None:
    """``Backend.write(request, admit=True)``: one call asks the policy (refusals counted as
    ``blocks_refused.admit``) and writes the admitted leading blocks; ``Outcome.refused`` is
    the rest. Without ``admit`` a write stores what it is given, unasked."""
    _Refusing.asked, _Refusing.fail = [], False
    backend = kvcore.open_backend(_Refusing, context={"layout": LAYOUT}, verify_blocks="never")
    try:
        block = np.zeros(LAYOUT.part_bytes("k"), dtype=np.uint8)
        ptr = block.ctypes.data
        host = kvcore.HostBuffers(tuple((ptr, ptr) for _ in range(5)), (block.nbytes,) * 2)
        done = backend.write(backend.request("w", list("abcde"), host=host), admit=True)
        assert (int(done), done.refused, done.failure) == (2, 3, None)
        assert _Refusing.asked == [5]
        assert backend.query(backend.request("q", list("abcde"))) == 2
        assert backend.stats()["blocks_refused.admit"] == 3
        assert backend.stats()["blocks.write"] == 2  # the refused three never reached write
        plain = backend.write(backend.request("w", list("vwxyz"), host=host))
        assert (int(plain), plain.refused) == (5, 0) and _Refusing.asked == [5]
        _Refusing.admit_first = 0
        none = backend.write(backend.request("w", list("fg"), host=host.slice(0, 2)), admit=True)
        assert (int(none), none.refused) == (0, 2)
    finally:
        _Refusing.admit_first = 2
        backend.close()
