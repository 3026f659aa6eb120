"""The kvcore L2 adapter on LMCache's own key, memory-object and bitmap classes, over kv_file
(and memory, tiered): what LMCache's controllers see, and what the store holds."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import key, load, lookup, memory_obj, random_obj, store, wait_fd
from kvcore_lmcache import l2_adapter_spec
from kvcore_lmcache.keys import block_key, key_fields, salt_id
from kvcore_lmcache.l2 import PART, KVCoreL2Adapter
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

from kvcore.keys import ObjectName
from kvcore.testing.corruption import flip_a_stored_bit


class Recorder(L2AdapterListener):
    def __init__(self) -> None:
        self.stored: list[tuple[object, int]] = []
        self.deleted: list[object] = []

    def on_l2_keys_stored(self, keys, sizes):  # type: ignore[no-untyped-def]
        self.stored.extend(zip(keys, sizes, strict=True))

    def on_l2_keys_accessed(self, keys):  # type: ignore[no-untyped-def]
        pass

    def on_l2_keys_deleted(self, keys):  # type: ignore[no-untyped-def]
        self.deleted.extend(keys)


def test_stored_objects_load_back_byte_for_byte_and_each_key_answers_alone(open_adapter):
    adapter = open_adapter()
    keys = [key(i) for i in range(5)]
    objs = [random_obj(i) for i in range(5)]
    result = store(adapter, [keys[i] for i in (0, 1, 3, 4)], [objs[i] for i in (0, 1, 3, 4)])
    assert result.is_successful() and result.bytes_transferred() == 4 * 2048
    # a key missing in the middle hides none after it (LMCache's bitmaps are per key)
    assert lookup(adapter, keys) == [0, 1, 3, 4]
    dst = [memory_obj(n=1024) for _ in keys]
    assert load(adapter, keys, dst) == [0, 1, 3, 4]
    for i in (0, 1, 3, 4):
        assert torch.equal(dst[i].tensor, objs[i].tensor)
    assert torch.count_nonzero(dst[2].tensor) == 0
    status = adapter.report_status()
    assert status["is_healthy"] and status["host.blocks_done.read"] == 4


@pytest.mark.parametrize(
    "field,other",
    [
        ("cache_salt", "tenant-b"),
        ("kv_rank", (2 << 24) | (1 << 16) | (2 << 8) | 1),
        ("kv_rank", (2 << 24) | (0 << 16) | (2 << 8) | 0),
        ("object_group_id", 1),
        ("model_name", "org/tiny-1.5-instruct"),
    ],
)
def test_keys_differing_in_one_field_never_share_an_object(open_adapter, field, other):
    adapter = open_adapter()
    stored = key(7, cache_salt="tenant-a")
    store(adapter, [stored], [random_obj(7)])
    fields = {
        "model_name": stored.model_name,
        "kv_rank": stored.kv_rank,
        "object_group_id": stored.object_group_id,
        "cache_salt": stored.cache_salt,
        field: other,
    }
    probe = type(stored)(chunk_hash=stored.chunk_hash, **fields)
    assert probe != stored
    assert lookup(adapter, [probe]) == []
    dst = memory_obj(n=1024)
    assert load(adapter, [probe], [dst]) == []
    assert torch.count_nonzero(dst.tensor) == 0
    # and a fresh adapter (another server) agrees
    assert lookup(open_adapter(), [probe, stored]) == [1]


@pytest.mark.parametrize(
    "model,salt",
    [
        ("meta-llama/Llama-3.1-8B", ""),
        ("a,b%2C.c", "x,y%z"),
        ("模型/ü", "user:42 ~ ünï"),
    ],
)
def test_a_block_key_decodes_back_to_every_field_and_holds_no_salt(model, salt):
    k = key(3, model_name=model, cache_salt=salt, kv_rank=0x02010201, object_group_id=5)
    text = block_key(k)
    assert "/" not in text and "\n" not in text
    assert not salt or salt not in text  # a salt is a secret: the key holds its id
    fields = key_fields(text)
    assert fields is not None
    assert fields == (k.chunk_hash, model, 0x02010201, 5, salt_id(salt))


def test_same_size_kv_of_another_dtype_is_never_loaded(open_adapter):
    adapter = open_adapter()
    k = key(1)
    store(adapter, [k], [random_obj(1, dtype=torch.float16)])
    as_bf16 = memory_obj(n=1024, dtype=torch.bfloat16)  # same 2048 bytes
    assert load(adapter, [k], [as_bf16]) == []
    assert adapter.report_status()["load_layout_mismatches"] == 1
    as_fp16 = memory_obj(n=1024, dtype=torch.float16)
    assert load(adapter, [k], [as_fp16]) == [0]
    # another size is a miss too (the store's object is not the buffer's)
    assert load(adapter, [k], [memory_obj(n=512)]) == []


def _payload_file(root: Path, payload: bytes) -> tuple[Path, int]:
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            at = data.find(payload)
            if at >= 0:
                return path, at
    raise AssertionError("no stored file holds the payload")


def test_a_flipped_bit_in_a_kv_file_object_is_a_counted_miss(open_adapter, root):
    adapter = open_adapter()
    k, obj = key(9), random_obj(9)
    store(adapter, [k], [obj])
    path, at = _payload_file(root, bytes(obj.byte_array))
    data = bytearray(path.read_bytes())
    data[at + 1000] ^= 0x10
    path.write_bytes(bytes(data))
    dst = memory_obj(n=1024)
    assert load(adapter, [k], [dst]) == []
    assert not torch.equal(dst.tensor, obj.tensor)  # nothing LMCache may use was delivered
    backend = adapter.backend
    assert backend is not None
    stats = backend.stats()
    assert stats["blocks.read"] >= 1 and stats.get("blocks_done.read", 0) == 0


def test_a_flipped_bit_in_a_memory_object_is_a_counted_miss(open_adapter):
    adapter = open_adapter(backend="memory", backend_config={})
    k, obj = key(4), random_obj(4)
    store(adapter, [k], [obj])
    backend = adapter.backend
    assert backend is not None
    name = next(n for n in backend.names() if (o := ObjectName.parse(n)) and o.part == PART)
    flip_a_stored_bit(backend, name, 2048)
    dst = memory_obj(n=1024)
    assert load(adapter, [k], [dst]) == []
    assert backend.stats()["corrupt_blocks.read"] == 1


def test_a_restarted_server_starts_from_what_the_store_holds(open_adapter):
    first = open_adapter()
    keys = [key(i, cache_salt="a" if i % 2 else "") for i in range(6)]
    store(first, keys, [random_obj(i) for i in range(6)])
    first.close()

    again = open_adapter()
    assert again.wait_seeded(30)
    # the names hold salts' ids: the keys of salt "a" wait until a request brings the salt
    assert dict(again.get_usage().bytes_by_cache_salt) == {"": 3 * 2048}
    assert again.report_status()["keys_unknown_salt"] == 3
    assert lookup(again, [key(99, cache_salt="a")]) == []
    assert _wait(lambda: again.get_usage().total_bytes_used == 6 * 2048)
    usage = again.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"": 3 * 2048, "a": 3 * 2048}
    late = Recorder()  # LMCache registers its listeners after building the adapter
    again.register_listener(late)
    assert sorted(late.stored, key=lambda p: p[0].chunk_hash) == [(k, 2048) for k in keys]
    # storing a key the store already holds is not counted twice
    store(again, keys[:1], [random_obj(0)])
    assert again.get_usage().total_bytes_used == 6 * 2048


def test_listing_decodes_every_stored_object_back_to_its_key(open_adapter):
    adapter = open_adapter()
    keys = [key(i) for i in range(5)] + [key(9, model_name="other/model", cache_salt="t")]
    store(adapter, keys, [random_obj(i) for i in range(6)])
    seen, cursor = [], None
    while True:
        page = adapter.list_l2_keys(page_size=2, cursor=cursor)
        seen += [(entry.key.to_object_key(), entry.size_bytes) for entry in page.entries]
        cursor = page.next_page_token
        if cursor is None:
            break
    assert sorted(seen, key=lambda p: block_key(p[0])) == sorted(
        [(k, 2048) for k in keys], key=lambda p: block_key(p[0])
    )
    only = adapter.list_l2_keys(model_name="other/model")
    assert [e.key.to_object_key() for e in only.entries] == [keys[-1]]
    with pytest.raises(ValueError, match="cursor"):
        adapter.list_l2_keys(cursor="not-a-key")
    with pytest.raises(ValueError, match="page_size"):
        adapter.list_l2_keys(page_size=0)


def test_a_key_locked_by_a_lookup_is_deleted_only_at_its_unlock(open_adapter):
    adapter = open_adapter()
    recorder = Recorder()
    adapter.register_listener(recorder)
    locked, free = key(1), key(2)
    store(adapter, [locked, free], [random_obj(1), random_obj(2)])
    assert lookup(adapter, [locked]) == [0]
    adapter.delete([locked, free])
    assert recorder.deleted == [free]
    assert lookup(adapter, [locked, free]) == [0]  # locked twice now
    adapter.submit_unlock([locked])
    assert lookup(open_adapter(), [locked]) == [0]  # one lock left
    adapter.submit_unlock([locked])
    adapter.submit_unlock([locked])  # an extra unlock is harmless
    adapter.close()  # waits for the deferred delete
    assert recorder.deleted == [free, locked]
    assert lookup(open_adapter(), [locked, free]) == []


def test_bad_settings_fail_the_start_naming_the_key():
    with pytest.raises(ValueError, match="backend_confg"):
        KVCoreL2Adapter({"backend": "file", "backend_confg": {}})
    with pytest.raises(ValueError, match="io_threads"):
        KVCoreL2Adapter({"backend": "memory", "io_threads": 0})
    with pytest.raises(Exception, match="no-such-backend"):
        KVCoreL2Adapter({"backend": "no-such-backend"})
    with pytest.raises(Exception, match="capacity_bytes"):
        KVCoreL2Adapter(
            {"backend": "file", "backend_config": {"root": "/tmp/x", "capacity_bytes": "lots"}}
        )


def test_a_bad_backend_config_is_one_line_naming_adapter_params(tmp_path):
    """The backend's own config is checked at the start too, and its bad key is named from
    where the user wrote it (it was a two-line error naming no adapter_params)."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError) as raised:
        KVCoreL2Adapter({"backend": "file", "backend_config": {"root": str(a_file)}})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("lmcache l2 adapter_params for kvcore: backend_config.root: "), (
        message
    )
    assert "is a regular file, not a directory" in message


def test_a_failing_store_is_a_counted_miss_never_an_error(open_adapter, root):
    adapter = open_adapter()
    keys = [key(i) for i in range(3)]
    store(adapter, keys, [random_obj(i) for i in range(3)])
    shutil.rmtree(root)  # the disk under the store is gone
    root.write_bytes(b"not a directory")
    assert not store(adapter, [key(5)], [random_obj(5)]).is_successful()
    dst = [memory_obj(n=1024) for _ in keys]
    assert load(adapter, keys, dst) == []
    assert all(torch.count_nonzero(d.tensor) == 0 for d in dst)
    status = adapter.report_status()
    assert status["host.blocks_done.write"] == 3 and status["host.blocks_done.read"] == 0
    assert status["is_healthy"]  # the adapter itself goes on


def test_a_root_that_cannot_hold_a_store_fails_the_start_naming_it(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    with pytest.raises(Exception, match="root"):
        KVCoreL2Adapter({"backend": "file", "backend_config": {"root": str(blocker / "s")}})


def test_lmcache_plugin_loader_builds_the_adapter_over_a_tiered_stack(tmp_path):
    spec = l2_adapter_spec(
        "tiered",
        backend_config={
            "tiers": [
                {"backend": "file", "root": str(tmp_path / "fast"), "capacity_bytes": "1MiB"},
                {"backend": "file", "root": str(tmp_path / "slow")},
            ]
        },
    )
    json.dumps(spec)  # what `lmcache server --l2-adapter` takes
    config = PluginL2AdapterConfig.from_dict(spec)
    adapter = create_l2_adapter_from_registry(config)
    try:
        assert isinstance(adapter, KVCoreL2Adapter)
        keys = [key(i) for i in range(3)]
        objs = [random_obj(i) for i in range(3)]
        assert store(adapter, keys, objs).is_successful()
        dst = [memory_obj(n=1024) for _ in keys]
        assert load(adapter, keys, dst) == [0, 1, 2]
        assert all(torch.equal(d.tensor, o.tensor) for d, o in zip(dst, objs, strict=True))
    finally:
        adapter.close()


def _wait(predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_objects_the_store_evicts_by_itself_are_deleted_keys_to_lmcache(open_adapter, root):
    adapter = open_adapter(backend_config={"root": str(root), "capacity_bytes": "64KiB"})
    recorder = Recorder()
    adapter.register_listener(recorder)
    keys = [key(i) for i in range(40)]
    for k in keys:  # one at a time: the store evicts the oldest to make room
        assert store(adapter, [k], [random_obj(0)]).is_successful()
    held = {e.key.to_object_key() for e in adapter.list_l2_keys(page_size=1000).entries}
    assert 0 < len(held) < len(keys)
    assert _wait(lambda: set(recorder.deleted) == set(keys) - held)
    assert adapter.get_usage().total_bytes_used == 2048 * len(held)
    assert adapter.report_status()["evicted_by_store"] == len(keys) - len(held)


def test_a_server_sharing_the_store_learns_what_another_stored(open_adapter):
    watcher = open_adapter()
    recorder = Recorder()
    watcher.register_listener(recorder)
    other = open_adapter()
    keys = [key(i, cache_salt="s") for i in range(3)]
    assert lookup(watcher, [key(99, cache_salt="s")]) == []  # the watcher has seen salt "s"
    store(other, keys, [random_obj(i) for i in range(3)])
    assert _wait(
        lambda: sorted(k.chunk_hash for k, _ in recorder.stored) == [k.chunk_hash for k in keys]
    )
    assert watcher.get_usage().bytes_by_cache_salt["s"] == 3 * 2048
    other.delete(keys[:1])
    assert _wait(lambda: recorder.deleted == keys[:1])


def _tiered(tmp_path: Path, name: str, mooncake_config: dict, **params: object) -> dict:
    return {
        "backend": "tiered",
        "backend_config": {
            "tiers": [
                {"backend": "file", "root": str(tmp_path / name)},
                {"backend": "mooncake", "config": mooncake_config},
            ]
        },
        **params,
    }


def test_local_disk_over_mooncake_shares_chunks_between_servers(tmp_path, mooncake_config):
    """The docs' stack (each server's own disk in front of a Mooncake cluster they share): a
    chunk one server stored reaches another through Mooncake, with its layout (kv_mooncake
    keeps block metadata), so it is checked and served; a buffer of another size is refused,
    also by a server that does not check layouts."""
    namespace = f"lmcache-{tmp_path.name}"  # the session's Mooncake is shared by every test
    writer = KVCoreL2Adapter(_tiered(tmp_path, "a", mooncake_config, namespace=namespace))
    k, obj = key(11), random_obj(11)
    try:
        assert store(writer, [k], [obj]).is_successful()
        assert load(writer, [k], [memory_obj(n=1024)]) == [0]  # its own disk keeps the layout
    finally:
        writer.close()

    strict = KVCoreL2Adapter(_tiered(tmp_path, "b", mooncake_config, namespace=namespace))
    try:
        assert lookup(strict, [k]) == [0]  # Mooncake holds it
        dst = memory_obj(n=1024)
        assert load(strict, [k], [dst]) == [0]  # with the layout its writer stored
        assert torch.equal(dst.tensor, obj.tensor)
        assert load(strict, [k], [memory_obj(n=1024, dtype=torch.bfloat16)]) == []
        assert strict.report_status()["load_layout_mismatches"] == 1
    finally:
        strict.close()

    trusting = KVCoreL2Adapter(
        _tiered(tmp_path, "c", mooncake_config, namespace=namespace, verify_layout=False)
    )
    try:
        dst = memory_obj(n=1024)
        assert load(trusting, [k], [dst]) == [0]
        assert torch.equal(dst.tensor, obj.tensor)
        assert load(trusting, [k], [memory_obj(n=512)]) == []
    finally:
        trusting.close()


def test_a_backend_that_keeps_no_layout_is_refused_unless_told_to_trust(no_meta_backend):
    with pytest.raises(ValueError, match="verify_layout"):
        KVCoreL2Adapter({"backend": no_meta_backend})
    trusting = KVCoreL2Adapter({"backend": no_meta_backend, "verify_layout": False})
    try:
        k, obj = key(21, cache_salt="no-meta"), random_obj(21)
        assert store(trusting, [k], [obj]).is_successful()
        dst = memory_obj(n=1024)
        assert load(trusting, [k], [dst]) == [0]
        assert torch.equal(dst.tensor, obj.tensor)
    finally:
        trusting.close()


def test_the_stores_admission_policy_is_honoured(open_adapter, root):
    """kv_file's ``admission: second-hit``: a key offered once is not written (a refusal, not
    a failed store), offered again it is; LMCache's listeners hear of the stored keys only."""
    config = {"root": str(root), "admission": "second-hit", "capacity_bytes": 4 << 20}
    adapter = open_adapter(backend_config=config)
    recorder = Recorder()
    adapter.register_listener(recorder)
    keys = [key(i) for i in range(3)]
    objs = [random_obj(i) for i in range(3)]
    first = store(adapter, keys, objs)
    assert first.is_successful() and first.bytes_transferred() == 0
    assert lookup(adapter, keys) == []
    assert recorder.stored == []
    assert adapter.backend.names() == []  # nothing of them on disk
    second = store(adapter, keys, objs)
    assert second.is_successful() and second.bytes_transferred() == 3 * 2048
    assert lookup(adapter, keys) == [0, 1, 2]
    assert [k for k, _ in recorder.stored] == keys
    dst = [memory_obj(n=1024) for _ in keys]
    assert load(adapter, keys, dst) == [0, 1, 2]
    assert all(torch.equal(d.tensor, o.tensor) for d, o in zip(dst, objs, strict=True))
    status = adapter.report_status()
    assert status["host.blocks_refused.write"] == 3 and status["host.blocks_done.write"] == 3
    assert status["kvcore_backend_admission_refused"] == 3


def test_lookups_answer_only_the_objects_worth_loading(open_adapter):
    """LMCache's L2 lookups go through kvcore's load-or-recompute decision (the rule of the
    core's tests/test_load_costs.py), weighed by the store's read rate measured from the
    adapter's own loads: an engine computing an object's tokens ten times faster than this
    store reads it is answered fewer objects than are stored (and locks none of those);
    ten times slower, all of them."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    keys = [key(i) for i in range(4)]
    store(open_adapter(), keys, [random_obj(i) for i in range(4)])
    descs = {0: MemoryLayoutDesc(shapes=[torch.Size([1024])], dtypes=[torch.float16])}
    found = {}
    for label, factor in (("slow_engine", 10.0), ("fast_engine", 0.1)):
        probe = open_adapter()
        for _ in range(3):
            assert load(probe, keys, [memory_obj(n=1024) for _ in keys]) == [0, 1, 2, 3]
        per_object_s = 2048 / probe._kv.opened.read_rate.figures()["bytes_per_s"]
        adapter = open_adapter(prefill_tokens_per_s=256 / (per_object_s * factor))
        for _ in range(3):
            assert load(adapter, keys, [memory_obj(n=1024) for _ in keys]) == [0, 1, 2, 3]
        task = adapter.submit_lookup_and_lock_task(keys, descs)
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        found[label] = adapter.query_lookup_and_lock_result(task).get_indices_list()
        found[label + "_status"] = adapter.report_status()
    assert found["slow_engine"] == [0, 1, 2, 3]
    assert len(found["fast_engine"]) < 4
    assert found["fast_engine_status"]["chunks_declined"] == 4 - len(found["fast_engine"])


def test_each_keys_tenant_comes_from_its_cache_salt(open_adapter, root, tmp_path):
    """The settings' ``tenants`` map a key's ``cache_salt`` to its tenant (kept as a digest);
    the store counts and keeps each tenant's objects apart, and no salt is in its files."""
    salts = tmp_path / "salts.json"
    salts.write_text(json.dumps({"salt-of-a-1f3e": "team-a"}))
    shares = {"tenants": {"team-a": {"reserved_bytes": 1 << 20}}}
    adapter = open_adapter(
        backend_config={"root": str(root), "tenants": shares},
        tenants={**shares, "salts_file": str(salts)},
    )
    keys = [key(i, cache_salt="salt-of-a-1f3e" if i < 3 else "") for i in range(5)]
    assert store(adapter, keys, [random_obj(i) for i in range(5)]).is_successful()
    assert lookup(adapter, keys) == [0, 1, 2, 3, 4]
    stats = adapter._kv.opened.stats()  # the facade's counts and the store's bytes, per tenant
    assert stats["tenant_blocks_done.write.team-a"] == 3
    assert stats["tenant_blocks_done.write.default"] == 2
    assert stats["backend_tenant_bytes_held.team-a"] >= 3 * 2048
    assert stats["backend_tenant_bytes_held.default"] >= 2 * 2048
    shown = [repr(stats)] + [str(p) for p in Path(root).rglob("*")]
    assert not any("salt-of-a-1f3e" in text for text in shown)


def test_no_salt_is_in_the_stores_names_files_or_events_and_unknown_salts_wait(open_adapter, root):
    """An MP key's ``cache_salt`` is a secret: the store's object names, files and events hold
    its id only. A server that never saw a salt lists no key of it (counted) and reports the
    keys another server stores with it once a request brings the salt."""
    secret = "salt-of-team-b-7a41"
    watcher = open_adapter()
    recorder = Recorder()
    watcher.register_listener(recorder)
    writer = open_adapter()
    keys = [key(i, cache_salt=secret) for i in range(4)]
    assert store(writer, keys, [random_obj(i) for i in range(4)]).is_successful()
    backend = writer._kv.opened
    assert backend is not None
    names = backend.names()
    files = [p for p in Path(root).rglob("*") if p.is_file()]
    shown = [*names, *(str(p) for p in files)]
    assert not any(secret in text for text in shown)
    assert not any(secret.encode() in p.read_bytes() for p in files)
    assert any(salt_id(secret) in name for name in names)
    assert _wait(lambda: watcher.report_status().get("keys_unknown_salt", 0) == 4)
    assert recorder.stored == [] and watcher.list_l2_keys().entries == ()
    assert lookup(watcher, [key(99, cache_salt=secret)]) == []
    assert _wait(lambda: len(recorder.stored) == 4)
    assert sorted(k.chunk_hash for k, _ in recorder.stored) == [k.chunk_hash for k in keys]
    assert {e.key.to_object_key() for e in watcher.list_l2_keys().entries} == set(keys)
