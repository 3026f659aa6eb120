"""Tenants' shares in kv_file (issue 61): every process sharing a root evicts by the shares,
the journal says whose each object is, and the store reports what each tenant holds."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from kv_file.journal import Kind, Record, decode, encode_records
from kv_file_testutil import LAYOUT, object_paths, open_store, read_verified, write

import kvcore
from kvcore.cli.stats import figures_of_scrape, figures_of_stats
from kvcore.metrics import Metrics

CHILD = str(Path(__file__).with_name("kv_file_child.py"))
CAPACITY = 8 << 20  # about 60 blocks of LAYOUT
HALF = CAPACITY // 2
SHARES = {"tenants": {"A": {"reserved_bytes": HALF}, "B": {}}}


def _config(tenants: dict | None, **more) -> dict:
    cfg: dict = {"capacity_bytes": CAPACITY, "admission": "all", **more}
    if tenants is not None:
        cfg["tenants"] = tenants
    return cfg


def _flood_from_another_process(root: str, cfg: dict, tenant: str, keys: list[str]) -> int:
    """``keys`` written as ``tenant`` by a process of its own; the blocks it acknowledged."""
    out = subprocess.run(
        [sys.executable, CHILD, "tenant_write", root, json.dumps(cfg), tenant, json.dumps(keys)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["acked"])


def _block_bytes(store: kvcore.Backend, key: str) -> int:
    return sum(os.path.getsize(p) for p in object_paths(store, key))


@pytest.mark.parametrize("shares", [True, False], ids=["reserved-half", "no-shares"])
def test_a_reserved_share_survives_another_processs_flood_of_ten_times_the_capacity(
    tmp_path, shares: bool
) -> None:
    root = str(tmp_path / "store")
    cfg = _config(SHARES if shares else None)
    quiet = [f"a-{i}" for i in range(20)]  # about a third of the store: within A's half
    with open_store(root, **cfg) as store:
        assert write(store, quiet, tenant="A") == len(quiet)
        flood_blocks = 10 * CAPACITY // _block_bytes(store, quiet[0])
        flood = [f"b-{i}" for i in range(flood_blocks)]
        acked = _flood_from_another_process(root, cfg, "B", flood)
        assert acked > 0.9 * len(flood)  # the flood was written, evicting as it went
        kept = read_verified(store, quiet)
        held = store.stats()
    if shares:
        assert kept == len(quiet), "tenant B's flood evicted blocks of A's reserved share"
        # ...and B still used the rest of the store: it is not idle room
        b_held = held["backend_tenant_bytes_held.B"]
        assert b_held >= CAPACITY * 0.85 - held["backend_tenant_bytes_held.A"] - (1 << 20)
    else:
        assert kept == 0, "without shares, LRU gives A's old blocks to B's flood"


def test_room_a_tenant_leaves_unused_is_used_by_others_and_given_back(tmp_path) -> None:
    cfg = _config(SHARES)
    with open_store(str(tmp_path / "store"), **cfg) as store:
        flood = [f"b-{i}" for i in range(200)]
        for start in range(0, len(flood), 8):
            write(store, flood[start : start + 8], tenant="B")
        stats = store.stats()
        # only B writes: it uses the whole store, A's reservation included
        assert stats["backend_tenant_bytes_held.B"] > 0.8 * CAPACITY
        assert stats["backend_tenant_bytes_held.A"] == 0
        # A comes back: B's blocks make room for it, and B's next writes evict B's own
        quiet = [f"a-{i}" for i in range(20)]
        assert write(store, quiet, tenant="A") == len(quiet)
        for start in range(0, len(flood), 8):
            write(store, [f"b2-{i}" for i in range(start, start + 8)], tenant="B")
        assert read_verified(store, quiet) == len(quiet)
        stats = store.stats()
        assert stats["backend_tenant_bytes_evicted.B"] > 0
        assert stats.get("backend_tenant_bytes_evicted.A", 0) == 0


def test_a_quota_evicts_the_tenants_own_blocks_and_no_one_elses(tmp_path) -> None:
    quota = 2 << 20
    cfg = _config({"tenants": {"B": {"quota_bytes": quota}}})
    with open_store(str(tmp_path / "store"), **cfg) as store:
        quiet = [f"a-{i}" for i in range(20)]  # A: no share at all, the default's LRU
        assert write(store, quiet, tenant="A") == len(quiet)
        one = _block_bytes(store, quiet[0])
        for start in range(0, 200, 8):
            write(store, [f"b-{i}" for i in range(start, start + 8)], tenant="B")
            assert store.stats()["backend_tenant_bytes_held.B"] <= quota
        assert store.stats()["backend_tenant_bytes_held.B"] > quota - 8 * one
        assert read_verified(store, quiet) == len(quiet)


def test_whose_each_object_is_survives_a_restart_and_a_compaction(tmp_path) -> None:
    root = str(tmp_path / "store")
    cfg = _config(SHARES)
    with open_store(root, **cfg) as store:
        write(store, [f"a-{i}" for i in range(5)], tenant="A")
        write(store, [f"b-{i}" for i in range(7)], tenant="B")
        write(store, [f"d-{i}" for i in range(3)])  # no tenant: the default's
        held = {k: v for k, v in store.stats().items() if ".bytes_held" in k or "held." in k}
        assert held["backend_tenant_bytes_held.A"] == sum(
            _block_bytes(store, f"a-{i}") for i in range(5)
        )
        assert held["backend_tenant_bytes_held.default"] == sum(
            _block_bytes(store, f"d-{i}") for i in range(3)
        )
    with open_store(root, **cfg) as store:  # rebuilt from the journal
        assert {k: v for k, v in store.stats().items() if "held." in k} == held
        catalog = store.plugin._catalog
        with catalog.journal.locked():  # a compaction: one stored record per object
            catalog.journal.replace(catalog._records_of(catalog.index.snapshot()))
    with open_store(root, **cfg) as store:
        assert {k: v for k, v in store.stats().items() if "held." in k} == held


def test_a_stored_records_tenant_is_skipped_by_a_reader_that_predates_it() -> None:
    record = Record(Kind.STORED, 2**100 + 5, 4096, b"ns/some-object", 7, b"team-a")
    data = encode_records([record])
    assert decode(data) == [record]
    # kv_file < 0.3 read the header with two spare bytes and went on by the record's length
    length, kind, _, lo, hi, size, origin, name_len = struct.unpack_from("<IBBxxQQQII", data)
    assert (kind, lo | hi << 64, size, origin) == (1, 2**100 + 5, 4096, 7)
    assert data[40 : 40 + name_len] == b"ns/some-object" and length == len(data)
    # and a record it wrote (nothing in the spare bytes) is the default tenant's
    old = struct.pack("<IBBxxQQQII", 48, 2, 0, 9, 0, 0, 3, 0) + bytes(8)
    assert decode(old) == [Record(Kind.EVICTED, 9, 0, None, 3, None)]


def test_each_tenants_bytes_are_in_prometheus_and_kvcore_stats(tmp_path) -> None:
    with open_store(str(tmp_path / "store"), **_config(SHARES)) as store:
        write(store, [f"a-{i}" for i in range(4)], tenant="A")
        write(store, [f"b-{i}" for i in range(2)], tenant="B")
        a_bytes = sum(_block_bytes(store, f"a-{i}") for i in range(4))
        stats = store.stats()
        text = Metrics(labels={"backend": "file"}).prometheus(
            {k: v for k, v in stats.items() if k.startswith("backend_")}
        )
        assert 'kvcore_backend_tenant_bytes_held{backend="file",tenant="A"} ' in text
        scraped = figures_of_scrape(text)["tenants"]
        assert scraped["A"]["store"] == {"bytes_held": a_bytes, "bytes_reserved": HALF}
        assert scraped["B"]["store"]["bytes_reserved"] == 0
        tenants = figures_of_stats(stats)["tenants"]
        assert tenants["A"]["store"]["bytes_held"] == a_bytes
        assert tenants["A"]["write"]["blocks_done"] == 4  # the facade's count, beside it


def test_reserved_shares_over_the_capacity_are_refused_naming_the_field(tmp_path) -> None:
    tenants = {"tenants": {"A": {"reserved_bytes": CAPACITY}, "B": {"reserved_bytes": 1}}}
    with pytest.raises(kvcore.ConfigError, match="tenants") as err:
        open_store(str(tmp_path / "store"), **_config(tenants))
    assert "reserved shares sum to" in str(err.value)
    assert LAYOUT.part_bytes("k") > 0


# -- deleting a tenant ---------------------------------------------------------------------------

NAMED = {"tenants": {"A": {}, "B": {}}}


def _clear_cli(root: str, cfg: dict, tenant: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcore", "clear", "file", "--tenant", tenant, "--json",
         "--config", json.dumps({"root": root, **cfg})],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _files_of(store: kvcore.Backend, keys: list[str]) -> int:
    return sum(os.path.exists(p) for k in keys for p in object_paths(store, k))


def test_kvcore_clear_tenant_removes_every_object_of_it_and_none_of_another_while_two_write(
    tmp_path,
) -> None:
    root = str(tmp_path / "store")
    cfg = _config(NAMED, capacity_bytes=256 << 20)  # no eviction: every A block must stay
    gone = [f"b-{i}" for i in range(60)]
    mine = [f"a-{i}" for i in range(150)]
    theirs = [f"a-peer-{i}" for i in range(150)]
    with open_store(root, **cfg) as store:
        assert write(store, gone, tenant="B") == len(gone)
        assert write(store, mine[:30], tenant="A") == 30
        # the other process writes A's blocks, this one too, while the CLI clears B
        peer = subprocess.Popen(
            [sys.executable, CHILD, "tenant_write", root, json.dumps(cfg), "A",
             json.dumps(theirs)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        clearing = subprocess.Popen(
            [sys.executable, "-m", "kvcore", "clear", "file", "--tenant", "B", "--json",
             "--config", json.dumps({"root": root, **cfg})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for start in range(30, len(mine), 8):
            assert write(store, mine[start : start + 8], tenant="A") == len(mine[start : start + 8])
        out, err = clearing.communicate(timeout=600)
        assert clearing.returncode == 0, err[-3000:]
        assert json.loads(out)["objects_removed"] == 2 * len(gone)
        peer_out, peer_err = peer.communicate(timeout=600)
        assert peer.returncode == 0, peer_err[-3000:]
        assert json.loads(peer_out)["acked"] == len(theirs)
        assert _files_of(store, gone) == 0, "objects of the cleared tenant are left"
        assert read_verified(store, gone) == 0
        assert read_verified(store, mine) == len(mine), "the clear removed tenant A's blocks"
        assert read_verified(store, theirs) == len(theirs)
        stats = store.stats()
        assert stats.get("backend_tenant_bytes_held.B", 0) == 0
        assert write(store, gone[:4], tenant="B") == 4  # B may come back


def test_a_clear_killed_midway_serves_nothing_of_the_tenant_and_a_restart_finishes_it(
    tmp_path,
) -> None:
    root = str(tmp_path / "store")
    cfg = _config(NAMED, capacity_bytes=64 << 20)
    gone = [f"b-{i}" for i in range(20)]
    kept = [f"a-{i}" for i in range(20)]
    with open_store(root, **cfg) as store:
        assert write(store, gone, tenant="B") == len(gone)
        assert write(store, kept, tenant="A") == len(kept)
        died = subprocess.run(
            [sys.executable, CHILD, "clear_and_die", root, json.dumps(cfg), "B"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert died.returncode == -9, died.stderr[-3000:]
        left = _files_of(store, gone)
        assert 0 < left < 2 * len(gone), "the SIGKILL did not land mid-clear"
        # this process (it was open all along) serves none of B's blocks that are left...
        assert read_verified(store, gone) == 0
        assert store.query(store.request("q", gone)) == 0
        assert not any(store.contains(store.request("c", gone)).found)
        # ...and stores none (its writes are refused while the clear is unfinished)
        assert write(store, [f"b-new-{i}" for i in range(4)], tenant="B") == 0
        assert read_verified(store, kept) == len(kept)
    with open_store(root, **cfg) as restarted:  # opening finishes the clear
        assert _files_of(restarted, gone) == 0
        assert restarted.stats()["backend_tenant_objects_cleared"] == left
        assert read_verified(restarted, kept) == len(kept)
        assert write(restarted, gone[:4], tenant="B") == 4
        assert read_verified(restarted, gone[:4]) == 4


def test_clearing_an_unknown_tenant_says_so_in_one_line(tmp_path) -> None:
    root = str(tmp_path / "store")
    with open_store(root, **_config(NAMED)) as store:
        write(store, ["a-0"], tenant="A")
    done = _clear_cli(root, _config(NAMED), "nobody")
    assert done.returncode == 1
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvcore: error:")]
    assert len(lines) == 1 and "unknown tenant 'nobody'" in lines[0], done.stderr
    bad = _clear_cli(root, _config(NAMED), "no/slash")
    assert bad.returncode == 2 and "--tenant: 'no/slash' is not a tenant name" in bad.stderr


def test_stored_evicted_and_removed_events_name_their_tenant(tmp_path) -> None:
    with open_store(str(tmp_path / "store"), **_config(None)) as store:
        sub = store.events.subscribe()
        write(store, [f"a-{i}" for i in range(20)], tenant="A")
        for start in range(0, 120, 8):
            write(store, [f"b-{i}" for i in range(start, start + 8)], tenant="B")
        store.clear(tenant="A")  # whatever of A is left
        events = sub.drain()
    seen = {(e.kind, e.tenant) for e in events if e.names}
    assert {("stored", "A"), ("stored", "B"), ("evicted", "A")} <= seen, seen
    assert all(e.tenant in ("A", "B") for e in events if e.names)
    assert ("removed", "B") not in seen


def test_kvcore_clear_without_a_tenant_clears_the_namespace(tmp_path) -> None:
    root = str(tmp_path / "store")
    with open_store(root, **_config(NAMED), context_namespace="ns1") as store:
        write(store, ["x-0", "x-1"], tenant="A")
    done = subprocess.run(
        [sys.executable, "-m", "kvcore", "clear", "file", "--namespace", "ns1",
         "--config", json.dumps({"root": root, **_config(NAMED)})],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cleared namespace 'ns1': 4 objects removed" in done.stdout
