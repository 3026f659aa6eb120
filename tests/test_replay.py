"""kvcore.replay and ``kvcore replay``: traces read strictly, exact prefix hits on hand-made
traces (the model and real kv_file I/O alike), the optimum checked by exhaustive search,
determinism, and the command's report and plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvcore.cli import main
from kvcore.replay import Bounds, TraceError, load_trace, replay
from kvcore.replay.model import optimal_hits, simulate, unlimited_hits
from kvcore.replay.trace import Trace, TraceRequest

pytest.importorskip("kv_file")

#: (input tokens, hash ids): 512-token blocks, the last one partly filled
PREFIXES = [
    (1300, [1, 2, 3]),  # 512 + 512 + 276 tokens
    (1100, [1, 2, 4]),
    (700, [1, 5]),
    (1300, [1, 2, 3]),
]


def write_trace(path: Path, rows: list[tuple[int, list[int]]]) -> Path:
    with path.open("w") as f:
        for n, (tokens, ids) in enumerate(rows):
            f.write(json.dumps({"timestamp": n * 10, "input_length": tokens,
                                "output_length": 5, "hash_ids": ids}) + "\n")  # fmt: skip
    return path


@pytest.fixture
def prefixes(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "prefixes.jsonl", PREFIXES)


# -- the trace ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: not JSON"),
        ("[1, 2]", r"line 2: a request must be a JSON object"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 3}', "'hash_ids'"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}',
         r"hash_ids\[1\] must be an integer in \[0, 2\*\*63\)"),
        ('{"timestamp": 1, "output_length": 1, "hash_ids": [1]}', "'input_length'"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "'timestamp'"),
    ],
)  # fmt: skip
def test_a_malformed_line_is_an_error_naming_the_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert f"{path}, line 2" in str(err.value)


_PEAK_REPORTER = """
import atexit, runpy, sys
def report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("KVCORE_TEST_VMHWM " + line.split()[1] + "\\n")
atexit.register(report)
sys.argv = ["kvcore", *sys.argv[1:]]
runpy.run_module("kvcore", run_name="__main__", alter_sys=True)
"""


def _cli_in_child(args: list[str], timeout: float = 60.0) -> tuple[int, str, int]:
    """``kvcore`` in a fresh process: exit code, stderr, and that process's own peak RSS in
    KiB (its ``VmHWM`` at exit: the rusage figures of a child also count the parent's memory
    at fork time, which a test process with 1 GB resident makes meaningless)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_REPORTER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stderr.splitlines()
    peaks = [int(x.split()[1]) for x in lines if x.startswith("KVCORE_TEST_VMHWM ")]
    err = "\n".join(x for x in lines if not x.startswith("KVCORE_TEST_VMHWM "))
    return proc.returncode, err, peaks[-1] if peaks else 1 << 40


@pytest.mark.parametrize(
    ("make", "message"),
    [
        ("dev_zero", "a device, not a regular file"),
        ("fifo", "a FIFO, not a regular file"),
        ("directory", "a directory, not a regular file"),
        ("million_ids", "line 2: longer than 1048576 bytes"),
        ("many_ids", "line 2: 'hash_ids' holds 20000 ids; a request may hold 16384"),
        ("long_line", "line 2: longer than 1048576 bytes"),
        ("digits", "line 2: a number of 5000 digits"),
        ("nesting", "line 2: JSON nested too deeply"),
        ("huge_id", r"hash_ids\[0\] must be an integer in \[0, 2\*\*63\)"),
    ],
)
def test_a_hostile_trace_is_refused_with_exit_2_in_bounded_memory(
    tmp_path: Path, make: str, message: str
) -> None:
    """Each of these crashed (MemoryError, ValueError, RecursionError: exit 70) or hung (a
    FIFO without a writer); now each is exit 2, one line naming the file (and line, field),
    with the child's peak RSS under 200 MiB (/dev/zero grew to 2.9 GiB in 7 s before)."""
    import os

    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    path = tmp_path / "t.jsonl"
    if make == "dev_zero":
        path = Path("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "directory":
        path = tmp_path
    elif make == "million_ids":
        ids = ",".join(str(i) for i in range(1_000_000))
        path.write_text(good + f'{{"timestamp": 0, "input_length": 5, "output_length": 1, '
                        f'"hash_ids": [{ids}]}}\n')  # fmt: skip
    elif make == "many_ids":
        ids = ",".join("7" for _ in range(20_000))
        path.write_text(good + f'{{"timestamp": 0, "input_length": 5, "output_length": 1, '
                        f'"hash_ids": [{ids}]}}\n')  # fmt: skip
    elif make == "long_line":
        path.write_text(good + "[" + " " * (2 << 20) + "]\n")
    elif make == "digits":
        path.write_text(good + '{"timestamp": 0, "hash_ids": [' + "7" * 5000 + "]}\n")
    elif make == "nesting":
        path.write_text(good + "[" * 200_000 + "]" * 200_000 + "\n")
    elif make == "huge_id":
        path.write_text(good.replace("[1]", f"[{2**63}]"))
    code, err, peak_kib = _cli_in_child(["replay", str(path), "--simulate"])
    assert code == 2, err[-2000:]
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and str(path) in lines[0], err[-2000:]
    assert re.search(message, lines[0]), lines[0]
    assert peak_kib < 200 << 10, f"peak RSS {peak_kib} KiB"


def test_an_empty_or_missing_trace_is_an_error(tmp_path: Path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_limit_and_counts(prefixes: Path):
    trace = load_trace(prefixes, limit=3)
    assert len(trace) == 3 and trace.block_refs == 8 and trace.distinct_blocks == 5
    assert trace.requests[0].block_tokens(2, 512) == 276


# -- exact hits -----------------------------------------------------------------------------


def test_all_at_four_blocks_by_hand(prefixes: Path):
    # r1 stores 1 2 3; r2 hits 1 2 (1024 tokens), stores 4; r3 hits 1 (512), stores 5 over 3
    # (the LRU: 3, untouched since r1); r4 hits 1 2 (1024), then 3 is missing
    tally, _ = simulate(load_trace(prefixes), 4, "all")
    assert (tally.block_hits, tally.token_hits) == (5, 2560)
    assert (tally.block_refs, tally.token_refs) == (11, 4400)
    assert (tally.blocks_written, tally.evictions) == (6, 2)


def test_second_hit_at_four_blocks_by_hand(prefixes: Path):
    # r1 offers 1 2 3 (first offers: none stored); r2 offers 1 2 4: 1 and 2 stored, 4 ends
    # the run; r3 hits 1, offers 5 (refused); r4 hits 1 2, offers 3, seen at r1: stored
    tally, _ = simulate(load_trace(prefixes), 4, "second-hit")
    assert (tally.block_hits, tally.blocks_written, tally.blocks_refused) == (3, 3, 5)


@pytest.mark.parametrize(
    ("policy", "hits", "written"), [("all", 5, 6), ("second-hit", 3, 3), ("adaptive", 5, 6)]
)
def test_real_kv_file_io_gives_the_models_exact_counts(
    prefixes: Path, tmp_path: Path, policy: str, hits: int, written: int
):
    trace = load_trace(prefixes)
    report = replay(trace, capacity_blocks=4, policy=policy,  # type: ignore[arg-type]
                    config={"root": str(tmp_path / "store")})  # fmt: skip
    simulated = replay(trace, capacity_blocks=4, policy=policy, simulate_only=True)  # type: ignore[arg-type]
    assert report["mode"] == "io" and report["mismatches"] == 0 and report["errors"] == 0
    assert (report["block_hits"], report["blocks_written"]) == (hits, written)
    for key in ("block_hits", "blocks_written", "blocks_refused", "evictions", "hit_rate_tokens"):
        assert report[key] == simulated[key], key
    assert report["bytes_written"] == written * 16 * 1024
    assert report["read_latency_ms_p50"] > 0 and simulated["read_latency_ms_p50"] is None
    assert not any((tmp_path / "store").glob("kvcore-replay-*/**/*.kv")), "data left behind"


def test_io_gives_the_models_exact_counts_while_the_journal_cycles(tmp_path: Path):
    """A store of ~2,000 small objects: kv_file's journal (a record per object) passes its
    floor and is rewritten several times during the replay, and the reads it logs depend on
    the clock. The room left to objects follows neither, so the I/O replay still counts
    exactly the model's hits (counting the journal at its current size, the store's room
    shrank as the journal grew: fewer hits than the model's)."""
    rng = np.random.default_rng(11)
    ids = rng.zipf(1.1, size=(2500, 4)) % 20000 + 1
    rows = [(2048, [0, *map(int, r)]) for r in ids]
    trace = load_trace(write_trace(tmp_path / "j.jsonl", rows))
    report = replay(trace, capacity_blocks=1000, policy="all",
                    config={"root": str(tmp_path / "store")})  # fmt: skip
    model = replay(trace, capacity_blocks=1000, policy="all", simulate_only=True)
    assert report["mismatches"] == 0 and report["errors"] == 0
    assert report["evictions"] > 3000  # the store was full for most of the trace
    keys = ("block_hits", "blocks_written", "evictions")
    assert [report[k] for k in keys] == [model[k] for k in keys]


def test_replays_are_deterministic(tmp_path: Path):
    rng = np.random.default_rng(7)
    rows = [(2048, [0, *rng.choice(np.arange(1, 40), 3, replace=False).tolist()])
            for _ in range(150)]  # fmt: skip
    trace = load_trace(write_trace(tmp_path / "r.jsonl", rows))
    runs = [
        replay(
            trace,
            capacity_blocks=12,
            policy="adaptive",
            config={"root": str(tmp_path / f"s{i}")},
            sample_rate=0.5,
        )
        for i in range(2)
    ]
    keys = ("block_hits", "blocks_written", "blocks_refused", "evictions", "bytes_written")
    assert [runs[0][k] for k in keys] == [runs[1][k] for k in keys]
    model = replay(trace, capacity_blocks=12, policy="adaptive", simulate_only=True,
                   sample_rate=0.5)  # fmt: skip
    assert [model[k] for k in keys] == [runs[0][k] for k in keys]


# -- the bounds -----------------------------------------------------------------------------


def _exhaustive_best(seq: list[int], capacity: int) -> int:
    """Most hits any cache of ``capacity`` can have on one-block requests ``seq``: every
    choice of what to keep after each miss (the new block or not, which to evict), searched."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for b in seq:
        nxt: dict[frozenset[int], int] = {}
        for held, hits in best.items():
            if b in held:
                options = [(held, hits + 1)]
            else:
                options = [(held, hits)]  # bypass
                if len(held) < capacity:
                    options.append((held | {b}, hits))
                else:
                    options += [((held - {v}) | {b}, hits) for v in held]
            for state, h in options:
                nxt[state] = max(nxt.get(state, -1), h)
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_the_optimum_found_by_exhaustive_search(seed: int):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 6, 14).tolist()
    trace = Trace(tuple(TraceRequest(0, 512, 1, (b,)) for b in seq))
    for capacity in (1, 2, 3):
        assert optimal_hits(trace, capacity).block_hits == _exhaustive_best(seq, capacity)


def test_no_policy_beats_the_optimum_nor_the_optimum_the_maximum(tmp_path: Path):
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(400):  # conversations: shared roots, growing prefixes, one-off tails
        root = int(rng.integers(0, 5))
        rows.append((4096, [root, 100 + root * 10 + int(rng.integers(0, 4)),
                            *rng.integers(1000, 9000, 3).tolist()]))  # fmt: skip
    trace = load_trace(write_trace(tmp_path / "c.jsonl", rows))
    maximum = unlimited_hits(trace).block_hits
    for capacity in (4, 16, 64):
        optimum = optimal_hits(trace, capacity).block_hits
        assert optimum <= maximum
        for policy in ("all", "second-hit", "adaptive"):
            assert simulate(trace, capacity, policy)[0].block_hits <= optimum, policy
    assert optimal_hits(trace, 10_000).block_hits == maximum


def test_bounds_are_computed_once_per_capacity(prefixes: Path):
    bounds = Bounds(load_trace(prefixes))
    assert bounds.optimum(4) is bounds.optimum(4)
    # unlimited: 1 2 hit in r2, 1 in r3, and 1 2 3 in r4 (all written by r1)
    assert bounds.maximum.block_hits == 6
    assert bounds.maximum is bounds.maximum


# -- the command ----------------------------------------------------------------------------


def test_command_reports_every_capacity_and_policy(prefixes: Path, capsys, tmp_path: Path):
    code = main(["replay", str(prefixes), "--simulate", "--json", "--policy", "all,second-hit",
                 "--capacities", "1024,2k"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 4 and out["distinct_blocks"] == 5
    runs = {(r["capacity_blocks"], r["policy"]): r for r in out["runs"]}
    assert set(runs) == {(2, "all"), (2, "second-hit"), (3, "all"), (3, "second-hit")}
    for r in runs.values():
        assert r["mode"] == "simulate" and 0 <= r["of_optimum"] <= 1


def test_command_io_replay_on_kv_file(prefixes: Path, capsys, tmp_path: Path):
    config = json.dumps({"root": str(tmp_path / "store")})
    code = main(["replay", str(prefixes), "--config", config, "--capacities", "2k"])
    assert code == 0
    text = capsys.readouterr().out
    assert "adaptive" in text and "io" in text and "maximum hit rate" in text


def test_command_names_the_bad_line_and_the_bad_option(tmp_path: Path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 0, "input_length": 5}\n')  # fmt: skip
    assert main(["replay", str(bad), "--simulate"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["replay", str(bad), "--simulate", "--capacities", "lots"]) == 2
    assert "--capacities: 'lots' is not a token count" in capsys.readouterr().err
    assert main(["replay", str(bad), "--simulate", "--policy", "lfu"]) == 2
    assert "--policy: 'lfu'" in capsys.readouterr().err
    good = write_trace(tmp_path / "good.jsonl", PREFIXES)
    assert main(["replay", str(good), "--simulate", "--backend", "memory"]) == 2
    assert "--backend: backend 'memory' offers no store model" in capsys.readouterr().err


def test_command_plots_hit_rate_against_capacity(prefixes: Path, tmp_path: Path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    code = main(["replay", str(prefixes), "--simulate", "--policy", "all,second-hit,adaptive",
                 "--capacities", "1024,2k,4k", "--plot", str(png), "--json"])  # fmt: skip
    assert code == 0 and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out)["plot"] == str(png)


def test_every_hand_made_policy_result_is_reachable_through_the_api(prefixes: Path):
    # the three policies in one sweep share one Bounds: one optimum per capacity
    bounds = Bounds(load_trace(prefixes))
    reports = [
        replay(bounds.trace, capacity_blocks=4, policy=p, simulate_only=True, bounds=bounds)
        for p in ("all", "second-hit", "adaptive")
    ]
    assert [r["block_hits"] for r in reports] == [5, 3, 5]
    assert len({r["optimum_hit_rate_blocks"] for r in reports}) == 1


def test_a_simulation_runs_on_the_backends_own_store_model(prefixes: Path):
    """The model is the backend's (issue 37): a backend without one is refused by name, one
    with its own is used, and kv_file's is what kv_file's class offers."""
    from kv_file.backend import FileBackend
    from kv_file.model import StoreModel
    from memory_backend import MemoryBackend

    trace = load_trace(prefixes)
    with pytest.raises(ValueError, match="backend 'memory' offers no store model"):
        simulate(trace, 4, "all", backend="memory")
    assert FileBackend.store_model is StoreModel

    class Everything(StoreModel):
        """A store that keeps every block (a capacity no eviction reaches)."""

        def __init__(self, capacity_blocks: int, policy: str, **kw: object) -> None:
            super().__init__(10_000, policy, **kw)  # type: ignore[arg-type]

    class Roomy(MemoryBackend):
        store_model = Everything

    tally, model = simulate(trace, 4, "all", backend=Roomy)
    assert isinstance(model, Everything)
    assert tally.block_hits == unlimited_hits(trace).block_hits
    assert tally.block_hits > simulate(trace, 4, "all")[0].block_hits
