"""``caller_idle``: a read the engine waits for with nothing computing says so to the backend,
on every call it makes (data, digests, spans of a paced load, a probe's reads), and no other
read does (:attr:`kvcore.BlockRequest.caller_idle`)."""

from __future__ import annotations

import numpy as np
import pytest
from memory_backend import MemoryBackend
from test_correctness import cache_of, keys, lay, part_bytes

import kvcore
from kvcore import hookimpl
from kvcore.store_probe import probe_read
from kvcore.transfer import TransferManager
from kvcore.transfer.integrity import DIGEST_PART


class _IdleSeen(MemoryBackend):
    """Records, for every read it answers, its parts and whether the caller waits idle."""

    reads: list[tuple[tuple[str, ...], bool]]

    @hookimpl
    def kvcore_read(self, request):
        self.reads.append((request.parts, request.caller_idle))
        return MemoryBackend.kvcore_read(self, request)


def test_a_slice_and_the_facades_request_keep_caller_idle() -> None:
    with kvcore.open_backend(MemoryBackend, context={"layout": lay()}) as backend:
        plain = backend.request("r", keys(4))
        idle = backend.request("r", keys(4), caller_idle=True)
        assert not plain.caller_idle and idle.caller_idle
        assert idle.slice(1, 3).caller_idle and not plain.slice(1, 3).caller_idle
        assert idle.with_buffers().caller_idle


@pytest.mark.parametrize("storage_io", ["host_resident", "staged"])
@pytest.mark.parametrize("paced", [False, True])
def test_a_load_the_engine_waits_for_idle_marks_every_read_it_makes_and_no_other(
    storage_io: str, paced: bool
) -> None:
    """Digests included (kvcore.integrity reads them with the data), and every span of a
    paced load; a load without the flag marks none: a backend would poll it at the lowest
    priority while the engine computes."""
    layout = lay(num_blocks=40)
    src = cache_of(layout, np.uint16, seed=5)
    staged = {"pipeline_blocks": 2} if storage_io == "staged" else {}
    be = kvcore.open_backend(_IdleSeen, context={"layout": layout}, verify_blocks="auto")
    tm = TransferManager(
        {"layout": layout, "max_model_len": 32 * 40, "storage_io": storage_io, **staged}, src, be
    )
    plugin = be.plugin
    ks, ids = keys(32, seed=5), list(range(32))
    assert tm.write_back({"task_id": "w", "keys": ks, "device_block_ids": ids}).result().ok
    pace = {"expected_s": 60.0} if paced else {}
    for idle in (True, False):
        plugin.reads = []
        dst = cache_of(layout, np.uint16, fill=False)
        tm.restore_caches(dst)
        task = {"task_id": f"r{idle}", "keys": ks, "device_block_ids": ids, **pace}
        result = tm.read({**task, "caller_idle": idle}).result()
        assert (result.outcome, result.num_blocks) == ("complete", 32)
        assert all(part_bytes(src, i) == part_bytes(dst, i) for i in ids)
        assert {parts for parts, _ in plugin.reads} == {(DIGEST_PART,), layout.parts}
        data = [parts for parts, _ in plugin.reads if parts == layout.parts]
        assert len(data) > 1 or not paced  # a paced load's spans, one call each
        assert {flag for _, flag in plugin.reads} == {idle}, plugin.reads
    tm.close()
    be.close()


def test_a_probe_reads_as_idle_as_the_request_it_was_asked_for() -> None:
    from test_runner import SIZE, _Buffers, _keys

    with kvcore.open_backend(_IdleSeen, context={"namespace": "probe-idle"}) as backend:
        backend.plugin.reads = []
        req = backend.request(
            "w", _keys(8), host=_Buffers(8).host(), parts=("obj",), part_bytes=(SIZE,)
        )
        assert backend.write(req) == 8
        for idle in (True, False):
            backend.plugin.reads = []
            bare = backend.request(
                "p", _keys(8), parts=("obj",), part_bytes=(SIZE,), caller_idle=idle
            )
            assert probe_read(backend, bare, max_bytes=4 * SIZE, budget_s=60.0).blocks > 0
            assert len(backend.plugin.reads) > 1
            assert {flag for _, flag in backend.plugin.reads} == {idle}
