"""Tenants (issue 61): their settings, the victim rule, and kv_file's store model with shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_file.model import StoreModel
from pydantic import ValidationError

from kvcore.cli import main
from kvcore.replay.model import simulate
from kvcore.replay.trace import Trace, TraceError, TraceRequest, flood_trace, merge_traces
from kvcore.tenants import DEFAULT_TENANT, TenantLRU, TenantSettings

SECRET = "s3cr3t-salt-of-team-a"


def settings(**tenants: dict[str, object]) -> TenantSettings:
    return TenantSettings(tenants=tenants)


# -- settings ---------------------------------------------------------------------------------


def one_line_error(exc: ValidationError) -> str:
    errors = exc.errors()
    assert len(errors) == 1, errors
    err = errors[0]
    return ".".join(str(p) for p in err["loc"]) + ": " + err["msg"]


@pytest.mark.parametrize(
    ("tenants", "field", "says"),
    [
        ({"a": {"reserved_bytes": -1}}, "tenants.a.reserved_bytes", "bytes >= 0, got -1"),
        ({"a": {"reserved_bytes": "-2GiB"}}, "tenants.a.reserved_bytes", "could not parse"),
        ({"a": {"quota_bytes": "lots"}}, "tenants.a.quota_bytes", "could not parse"),
        ({"a": {"quota_bytes": True}}, "tenants.a.quota_bytes", "not a boolean"),
        ({"a": {"quota_bytes": 0}}, "tenants.a.quota_bytes", "greater than 0"),
        (
            {"a": {"reserved_bytes": "2GiB", "quota_bytes": "1GiB"}},
            "tenants.a",
            "quota_bytes (1073741824) is below reserved_bytes (2147483648)",
        ),
        ({"a/b": {}}, "tenants", "'a/b' is not a tenant name"),
        ({"a": {"reserved": 1}}, "tenants.a.reserved", "Extra inputs"),
    ],
)
def test_a_bad_share_is_one_error_naming_its_field(
    tenants: dict[str, object], field: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        TenantSettings(tenants=tenants)
    line = one_line_error(caught.value)
    assert line.startswith(field), line
    assert says in line, line


def test_reserved_shares_over_the_capacity_are_refused_naming_the_field() -> None:
    shares = settings(a={"reserved_bytes": "6GiB"}, b={"reserved_bytes": "5GiB"})
    shares.check_capacity(11 << 30)
    with pytest.raises(
        ValueError,
        match=r"^tenants: the reserved shares sum to 11811160064 bytes, over the store's capacity of 10737418240 bytes$",
    ):
        shares.check_capacity(10 << 30)
    with pytest.raises(ValueError, match=r"^tenants:"):
        StoreModel(4, "all", block_bytes=1 << 30, tenants=shares)


def test_a_salt_is_never_in_an_error_or_a_repr() -> None:
    for salts in ({SECRET: "nobody"}, {SECRET: "bad/name"}, {SECRET: 5}):
        with pytest.raises(ValidationError) as caught:
            TenantSettings(tenants={"a": {}}, salts=salts)
        assert SECRET not in str(caught.value)
        assert "salts" in str(caught.value)
    good = TenantSettings(tenants={"a": {}}, salts={SECRET: "a"})
    assert SECRET not in repr(good) and SECRET not in str(good)


def test_requests_map_to_tenants_by_name_then_salt_else_the_default() -> None:
    shares = TenantSettings(tenants={"a": {}, "b": {}}, salts={SECRET: "a"})
    assert shares.tenant_of(salt=SECRET) == "a"
    assert shares.tenant_of(tenant="b", salt=SECRET) == "b"
    assert shares.tenant_of(tenant="unnamed", salt=SECRET) == "a"
    assert shares.tenant_of(salt="another salt") == DEFAULT_TENANT
    assert shares.tenant_of() == DEFAULT_TENANT
    assert shares.tenant_of(tenant="../x", salt=SECRET) == "a"  # a user's bad name: ignored
    assert shares.check_known("b") == "b"
    with pytest.raises(
        ValueError, match=r"^tenant: unknown tenant 'c' \(known: \['a', 'b', 'default'\]\)$"
    ):
        shares.check_known("c")


# -- the victim rule --------------------------------------------------------------------------


def test_a_tenant_within_its_reserved_share_loses_nothing_to_others() -> None:
    book: TenantLRU[int] = TenantLRU(settings(a={"reserved_bytes": 3}))
    for k in (1, 2, 3):
        book.add(k, "a", 1)  # a: 3 bytes, its whole share, and the oldest
    for k in (10, 11):
        book.add(k, "b", 1)
    assert book.victim("b") == 10  # b's own oldest: a is within its share
    assert book.victim("c") == 10  # anyone's write: b is the one over its share (0)
    book.add(4, "a", 1)  # a goes one over its share: its oldest is now the oldest candidate
    assert book.victim("b") == 1
    assert book.victim("b", keep={1}) == 2


def test_without_shares_victims_are_one_lru_over_every_tenant() -> None:
    book: TenantLRU[int] = TenantLRU(TenantSettings())
    book.add(1, "a", 1)
    book.add(2, "b", 1)
    book.add(3, "a", 1)
    book.touch([1])
    assert [book.victim("x") for _ in range(1)] == [2]
    assert book.remove(2) == 1
    assert book.victim("x") == 3


def test_where_no_tenant_is_over_its_share_the_writer_evicts_its_own_or_nothing() -> None:
    book: TenantLRU[int] = TenantLRU(settings(a={"reserved_bytes": 2}, b={"reserved_bytes": 2}))
    book.add(1, "a", 1)
    book.add(2, "a", 1)
    book.add(3, "b", 1)
    book.add(4, "b", 1)
    assert book.victim("b") == 3
    assert book.victim("c") is None
    assert book.victim("b", keep={3, 4}) is None


def test_a_quota_takes_only_the_tenants_own_blocks() -> None:
    book: TenantLRU[int] = TenantLRU(settings(b={"quota_bytes": 2}))
    book.add(1, "a", 1)
    book.add(2, "b", 1)
    book.add(3, "b", 1)
    assert book.over_quota("b", 1) and not book.over_quota("a", 100)
    assert book.own_victim("b") == 2
    assert book.own_victim("b", keep={2, 3}) is None


# -- kv_file's store model with tenants ---------------------------------------------------------


def flood(model: StoreModel, tenant: str, first: int, blocks: int) -> None:
    for b in range(first, first + blocks):
        model.serve([b], tenant)


def test_a_reserved_share_survives_a_flood_ten_times_the_store_and_no_share_does_not() -> None:
    hot = list(range(1, 9))  # 8 of a 16-block store
    for shares, survives in (
        (settings(a={"reserved_bytes": 8}, b={}), True),
        (TenantSettings(), False),
    ):
        model = StoreModel(16, "all", block_bytes=1, tenants=shares)
        assert model.serve(hot, "a") == (0, 8, 0)
        flood(model, "b", 1000, 160)
        hits, _, _ = model.serve(hot, "a")
        assert (hits == len(hot)) is survives, shares
        assert model.files_bytes <= 16
        assert model.evicted_by["a"] == (0 if survives else 8)


def test_room_a_tenant_leaves_unused_is_used_by_others_and_given_back() -> None:
    model = StoreModel(16, "all", block_bytes=1, tenants=settings(a={"reserved_bytes": 8}, b={}))
    flood(model, "b", 1000, 16)
    assert model.book is not None and model.book.used["b"] == 16  # a's unused half, b's now
    assert model.serve(list(range(1, 9)), "a") == (0, 8, 0)  # and back for a, from b's oldest
    assert model.book.used == {"a": 8, "b": 8}
    assert model.book.entries("b") == list(range(1008, 1016))


def test_a_tenant_at_its_quota_cycles_its_own_blocks_and_never_exceeds_it() -> None:
    model = StoreModel(16, "all", block_bytes=1, tenants=settings(b={"quota_bytes": 4}))
    model.serve([1, 2, 3], "a")
    flood(model, "b", 1000, 20)
    assert model.book is not None and model.book.used == {"a": 3, "b": 4}
    assert model.serve([1, 2, 3], "a")[0] == 3
    # one request longer than its quota: its own earlier blocks are being written, so it stops
    hits, written, _ = model.serve(list(range(2000, 2006)), "b")
    assert (hits, written) == (0, 4) and model.refused_by["b"] == 2
    assert model.book.used["b"] == 4


def test_without_tenants_the_model_counts_as_before() -> None:
    ids = [[1, 2, 3], [1, 2, 4], [5, 6, 7, 8], [1, 2, 3]]
    plain, shared = StoreModel(5, "all"), StoreModel(5, "all", tenants=TenantSettings())
    assert [plain.serve(r) for r in ids] == [shared.serve(r) for r in ids]
    assert plain.evictions == shared.evictions


# -- traces of several tenants ------------------------------------------------------------------


def trace_of(*stamps_ids: tuple[float, tuple[int, ...]], tpb: int = 4) -> Trace:
    return Trace(tuple(TraceRequest(t, len(ids) * tpb, 1, ids) for t, ids in stamps_ids), tpb)


def test_traces_merge_by_time_each_request_tagged_with_its_tenant() -> None:
    a = trace_of((0, (1,)), (10, (1, 2)), (20, (3,)))
    b = trace_of((5, (1,)), (10, (9,)))
    merged = merge_traces({"a": a, "b": b})
    assert [(r.timestamp_ms, r.tenant, r.hash_ids) for r in merged.requests] == [
        (0, "a", (1,)),
        (5, "b", (1,)),
        (10, "a", (1, 2)),
        (10, "b", (9,)),
        (20, "a", (3,)),
    ]
    with pytest.raises(TraceError, match="tokens_per_block differ"):
        merge_traces({"a": a, "b": trace_of((0, (1,)), tpb=8)})
    with pytest.raises(TraceError, match="no traces"):
        merge_traces({})


def test_a_flood_is_unique_blocks_spread_over_its_span() -> None:
    f = flood_trace(10, requests=4, span_ms=30, tokens_per_block=4, start_ms=100)
    assert [r.timestamp_ms for r in f.requests] == [100, 110, 120, 130]
    ids = [b for r in f.requests for b in r.hash_ids]
    assert sorted(ids) == list(range(10))
    with pytest.raises(TraceError, match="blocks and requests must be >= 1"):
        flood_trace(0, requests=1, span_ms=1)


def test_a_replay_with_tenants_counts_each_and_keys_equal_ids_apart() -> None:
    a = trace_of((0, (1, 2)), (2, (1, 2)))
    b = trace_of((1, (1, 2)), (3, (1, 2)))
    merged = merge_traces({"a": a, "b": b})
    tally, _ = simulate(merged, 100, "all", block_bytes=1, tenants=TenantSettings())
    # b's blocks 1 and 2 are not a's: each tenant hits only its own second request
    assert tally.tenants["a"].block_hits == 2 and tally.tenants["b"].block_hits == 2
    assert tally.block_hits == 4 and tally.block_refs == 8
    assert sum(t.blocks_written for t in tally.tenants.values()) == tally.blocks_written == 4


# -- `kvcore replay` with tenants ---------------------------------------------------------------


def write_trace(path: Path, rows: list[list[int]], tpb: int = 512) -> Path:
    with path.open("w") as f:
        for n, ids in enumerate(rows):
            row = {"timestamp": n * 10, "input_length": len(ids) * tpb, "output_length": 1,
                   "hash_ids": ids}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


#: a quiet tenant: a hot 4-block prefix reread by every request, after some unique blocks
QUIET = [[1, 2, 3, 4, 100 + n] for n in range(40)]


@pytest.mark.parametrize("mode", ["simulate", "io"])
def test_replay_reports_each_tenant_and_a_share_keeps_the_quiet_one(
    tmp_path: Path, capsys, mode: str
) -> None:
    quiet = write_trace(tmp_path / "quiet.jsonl", QUIET)
    # a store of 16 blocks (16 KiB each); the flood writes 16 between two quiet requests
    how = ["--simulate"] if mode == "simulate" else [
        "--config", json.dumps({"root": str(tmp_path / "store")})]  # fmt: skip
    common = ["replay", str(quiet), *how, "--json", "--policy", "all",
              "--capacities", "8192", "--as", "quiet", "--flood", "noisy=40"]  # fmt: skip
    half = json.dumps({"tenants": {"quiet": {"reserved_bytes": 8 * 16384}}})
    rates = {}
    for label, shares in (("none", "{}"), ("half", half)):
        assert main([*common, "--tenants", shares]) == 0
        run = json.loads(capsys.readouterr().out)["runs"][0]
        assert run["mode"] == mode and run["mismatches"] == run["errors"] == 0
        assert set(run["tenants"]) == {"quiet", "noisy"}
        assert run["tenants"]["noisy"]["block_hits"] == 0
        assert run["tenants"]["noisy"]["requests"] == 40 and run["requests"] == 80
        rates[label] = run["tenants"]["quiet"]["hit_rate_blocks"]
    assert rates["none"] == 0.0  # each flood evicts the whole hot prefix
    assert rates["half"] == pytest.approx(39 * 4 / 200)  # every later request hits it


def test_replay_of_tenants_traces_through_kv_file_counts_each(tmp_path: Path, capsys):
    a = write_trace(tmp_path / "a.jsonl", [[1, 2], [1, 2], [1, 3]])
    b = write_trace(tmp_path / "b.jsonl", [[1, 2], [1, 2]])
    config = json.dumps({"root": str(tmp_path / "store")})
    assert main(["replay", str(a), "--tenant", f"b={b}", "--as", "a", "--policy", "all",
                 "--config", config, "--capacities", "100k", "--json"]) == 0  # fmt: skip
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["mode"] == "io" and run["mismatches"] == 0 and run["errors"] == 0
    # equal ids of two tenants are two blocks: b hits only its own second request
    assert run["tenants"]["a"]["block_hits"] == 3 and run["tenants"]["b"]["block_hits"] == 2
    assert run["tenants"]["a"]["blocks_written"] == 3 and run["tenants"]["b"]["blocks_written"] == 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tenant", "b"], "--tenant: 'b' is not NAME=VALUE"),
        (["--tenant", "b/c=x.jsonl"], "--tenant: 'b/c' is not a tenant name"),
        (["--flood", "b=lots"], "--flood b: 'lots' must be a number of capacities"),
        (["--flood", "b=-1"], "--flood b: '-1' must be a number of capacities"),
        (["--flood", "default=10"], "--flood: tenant 'default' is given twice"),
        (["--tenants", '{"tenants": {"a": {"reserved_bytes": -1}}}'],
         "--tenants: tenants.a.reserved_bytes: "),
        (["--simulate", "--tenants", '{"tenants": {"a": {"quota_bytes": "x"}}}'],
         "--tenants: tenants.a.quota_bytes: could not parse"),
        (["--simulate", "--tenants", '{"tenants": {"a": {"reserved_bytes": "1GiB"}}}'],
         "--tenants: tenants: the reserved shares sum to 1073741824 bytes, over the store's"),
        (["--simulate", "--tenants", '{"salts": {"secret-salt": "nobody"}}'],
         "--tenants: salts: entry 0 maps to tenant 'nobody'"),
    ],
)  # fmt: skip
def test_replay_refuses_bad_tenant_options_in_one_line(
    tmp_path: Path, capsys, args: list[str], says: str
) -> None:
    quiet = write_trace(tmp_path / "quiet.jsonl", QUIET)
    code = main(["replay", str(quiet), "--capacities", "4096", *args])
    err = capsys.readouterr().err
    assert code in (2, 3), err
    errors = [line for line in err.splitlines() if line.startswith("kvcore: error:")]
    assert len(errors) == 1 and says in errors[0], err
    assert "secret-salt" not in err


# -- an engine adapter's settings ---------------------------------------------------------------


def test_every_adapters_settings_take_tenants_and_map_each_request(tmp_path: Path) -> None:
    from kvcore.config import EngineBackendSettings

    plain = EngineBackendSettings(backend="memory")
    assert plain.tenant_of(salt=SECRET) is None  # no tenants set: requests name none
    settings = EngineBackendSettings(
        backend="memory",
        tenants={"tenants": {"chat": {"reserved_bytes": "1GiB"}}, "salts": {SECRET: "chat"}},
    )
    assert settings.tenant_of(salt=SECRET) == "chat"
    assert settings.tenant_of(salt="another") == DEFAULT_TENANT
    assert settings.tenant_of(tenant="chat") == "chat"
    assert SECRET not in repr(settings)
    with pytest.raises(ValidationError) as caught:
        EngineBackendSettings(backend="memory", tenants={"salts": {SECRET: "nobody"}})
    assert SECRET not in str(caught.value) and "entry 0 maps to tenant 'nobody'" in str(
        caught.value
    )


def test_salts_are_kept_as_digests_from_a_file_or_given_as_digests(tmp_path: Path) -> None:
    import hashlib

    salts = tmp_path / "salts.json"
    salts.write_text(json.dumps({SECRET: "a", "another-secret": "b"}))
    digest = hashlib.sha256(b"third-secret").hexdigest()
    shares = TenantSettings(
        tenants={"a": {}, "b": {}, "c": {}},
        salts_file=str(salts),
        salt_sha256={digest.upper(): "c"},
    )
    assert shares.tenant_of(salt=SECRET) == "a"
    assert shares.tenant_of(salt="another-secret") == "b"
    assert shares.tenant_of(salt="third-secret") == "c"
    dumped = json.dumps(shares.model_dump())
    assert SECRET not in dumped and SECRET not in repr(shares)
    assert SECRET not in json.dumps(TenantSettings(salts={SECRET: "default"}).model_dump())
    salts.write_text(json.dumps({SECRET: "nobody"}))
    for bad, says in (
        ({"salts_file": str(tmp_path / "missing.json")}, "salts_file: cannot read"),
        ({"salts_file": str(salts)}, "maps to tenant 'nobody'"),
        ({"salt_sha256": {SECRET: "a"}}, "entry 0: not a SHA-256 digest"),
    ):
        with pytest.raises(ValidationError) as caught:
            TenantSettings(tenants={"a": {}}, **bad)
        assert says in str(caught.value) and SECRET not in str(caught.value)
    salts.write_text("{not json")
    with pytest.raises(ValidationError, match="is not a JSON object of salt -> tenant"):
        TenantSettings(salts_file=str(salts))
