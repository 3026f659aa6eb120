"""CPU tests of kvcore.ops: byte-exact round trips against a numpy reference, each on the C++
extension and on its Python twin (what an install built without a compiler runs)."""

from __future__ import annotations

import gc
import math
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kvcore import _swap, _swap_py, ops
from kvcore.ops import HostBuffer, swap_cache_all_layers, swap_cache_layout

paddle = pytest.importorskip("paddle")


@pytest.fixture(autouse=True, params=["native", "python"])
def swap_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Every test on both implementations of the swap ops."""
    impl = _swap if request.param == "native" else _swap_py
    monkeypatch.setattr(ops, "_swap", impl)
    return impl


BLOCK = (2, 16, 8)  # heads, block_size, head_dim
RNG = np.random.default_rng(1234)


def as_bytes(t: Any) -> np.ndarray:
    """Zero-copy [num_blocks, block_bytes] uint8 view of a numpy array or CPU Paddle tensor."""
    if isinstance(t, np.ndarray):
        return t.view(np.uint8).reshape(t.shape[0], -1)
    return np.from_dlpack(t.view(paddle.uint8)).reshape(t.shape[0], -1)


def make_layer(lib: str, dtype: str, nblocks: int, block: tuple[int, ...] = BLOCK) -> Any:
    """A cache tensor filled with random bytes (any bit pattern, NaNs included)."""
    shape = [nblocks, *block]
    if lib == "numpy":
        np_dtype = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}.get(dtype, dtype)
        t = np.empty(shape, dtype=np_dtype)
    else:
        t = paddle.zeros(shape, dtype="float32").astype(dtype)
    as_bytes(t)[...] = RNG.integers(0, 256, as_bytes(t).shape, dtype=np.uint8)
    return t


def make_layers(lib: str, dtype: str, nlayers: int, nblocks: int, **kw: Any) -> list[Any]:
    return [make_layer(lib, dtype, nblocks, **kw) for _ in range(nlayers)]


def block_nbytes(t: Any) -> int:
    return as_bytes(t).shape[1]


def random_pairs(n: int, dev_blocks: int, other_blocks: int) -> tuple[list[int], list[int]]:
    dev = RNG.choice(dev_blocks, n, replace=False)
    other = RNG.choice(other_blocks, n, replace=False)
    return dev.tolist(), other.tolist()


# Cache tensor sets per dtype: block-wise fp8 also swaps float32 scales [blocks, heads, bs].
DTYPE_CASES = ["bfloat16", "float16", "uint8", "float8_e4m3fn+scales"]
LIBS = ["paddle", "numpy"]


def tensor_sets(lib: str, case: str, nlayers: int, nblocks: int) -> list[list[Any]]:
    if case.endswith("+scales"):
        data = make_layers(lib, case.split("+")[0], nlayers, nblocks)
        scales = make_layers(lib, "float32", nlayers, nblocks, block=BLOCK[:2])
        return [data, scales]
    return [make_layers(lib, case, nlayers, nblocks)]


# --------------------------------------------------------------------------- swap_cache_all_layers


def check_all_layers_round_trip(
    layers: list[Any], dev_ids: list[int], host_ids: list[int], max_host: int, **kw: Any
) -> None:
    bb = block_nbytes(layers[0])
    hosts = [HostBuffer(max_host * bb, pinned=False) for _ in layers]
    for h in hosts:
        h.array[...] = RNG.integers(0, 256, h.nbytes, dtype=np.uint8)
    host_before = [h.array.copy() for h in hosts]
    dev_before = [as_bytes(t).copy() for t in layers]

    swap_cache_all_layers(layers, [h.ptr for h in hosts], max_host, dev_ids, host_ids, 0, 0, **kw)
    for t, h, before in zip(layers, hosts, host_before, strict=True):
        expect = before.reshape(max_host, bb).copy()
        expect[host_ids] = as_bytes(t)[dev_ids]
        np.testing.assert_array_equal(h.view(np.uint8, (max_host, bb)), expect)

    for t in layers:
        as_bytes(t)[...] = 0
    swap_cache_all_layers(layers, hosts, max_host, dev_ids, host_ids, 0, 1, **kw)
    for t, before in zip(layers, dev_before, strict=True):
        expect = np.zeros_like(before)
        expect[dev_ids] = before[dev_ids]
        np.testing.assert_array_equal(as_bytes(t), expect)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_all_layers_round_trip(lib: str, case: str) -> None:
    for layers in tensor_sets(lib, case, nlayers=3, nblocks=12):
        dev_ids, host_ids = random_pairs(7, 12, 20)
        check_all_layers_round_trip(layers, dev_ids, host_ids, max_host=20)


def test_all_layers_merged_runs_boundaries() -> None:
    layers = make_layers("paddle", "bfloat16", 4, 16)
    # Runs consecutive on both sides, on one side only, single blocks, and a descending pair.
    dev_ids = [0, 1, 2, 5, 6, 9, 3, 4, 15, 14, 10, 11]
    host_ids = [10, 11, 12, 13, 14, 2, 0, 1, 20, 19, 16, 18]
    check_all_layers_round_trip(layers, dev_ids, host_ids, max_host=21)


def test_all_layers_full_contiguous_run() -> None:
    layers = make_layers("numpy", "float16", 2, 8)
    check_all_layers_round_trip(layers, list(range(8)), list(range(3, 11)), max_host=11)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_give_identical_bytes(threads: int) -> None:
    layers = make_layers("paddle", "bfloat16", 3, 32)
    # Random pairs plus one 4-block run that the byte split cuts across threads.
    dev_ids = [*RNG.permutation(20)[:16].tolist(), 20, 21, 22, 23]
    host_ids = [*RNG.permutation(30)[:16].tolist(), 30, 31, 32, 33]
    bb = block_nbytes(layers[0])
    outs = []
    for n in (1, threads):
        hosts = [HostBuffer(40 * bb, pinned=False) for _ in layers]
        swap_cache_all_layers(layers, hosts, 40, dev_ids, host_ids, 0, 0, num_threads=n)
        staging = HostBuffer(20 * 3 * bb, pinned=False)
        swap_cache_layout(layers, staging, [32, *BLOCK], dev_ids, range(20), 0, 0, num_threads=n)
        outs.append([h.view(np.uint8, (40, bb))[host_ids].copy() for h in hosts])
        outs[-1].append(staging.array.copy())
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)
    check_all_layers_round_trip(layers, dev_ids, host_ids, max_host=40, num_threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_large_calls_stream_exact_bytes_at_any_alignment(threads: int) -> None:
    """Calls of 32 MiB and more write with non-temporal stores on x86-64: blocks of an odd size
    (1785 bytes) put every piece at another alignment, each with a head and tail to copy."""
    block = (3, 17, 35)
    layers = make_layers("numpy", "uint8", 2, 12_000, block=block)
    assert sum(t.nbytes for t in layers) >= 32 << 20
    dev_ids, host_ids = random_pairs(11_000, 12_000, 12_500)
    check_all_layers_round_trip(layers, dev_ids, host_ids, max_host=12_500, num_threads=threads)
    n = len(dev_ids)
    check_layout_round_trip(
        layers, [12_000, *block], dev_ids, list(range(n)), n, num_threads=threads
    )


def test_thread_count_resolution(monkeypatch: pytest.MonkeyPatch, swap_impl: ModuleType) -> None:
    monkeypatch.setenv("KVCORE_SWAP_THREADS", "3")
    assert swap_impl.resolve_threads(0, 64 << 20) == 3
    assert swap_impl.resolve_threads(0, 512 << 10) == 1  # small copies stay single-threaded
    assert swap_impl.resolve_threads(5, 64 << 20) == 5  # an explicit request wins
    assert swap_impl.resolve_threads(8, 8192) == 2  # at most one thread per 4 KiB
    monkeypatch.delenv("KVCORE_SWAP_THREADS")
    assert 1 <= swap_impl.resolve_threads(0, 64 << 20) <= 4
    assert ops.copy_threads(None, 64 << 20) == _swap.resolve_threads(0, 64 << 20)


def test_all_layers_offset_view_tensor() -> None:
    # data_ptr() of a contiguous slice includes its offset (Paddle cannot dlpack such a view, so
    # the reference reads the base tensor).
    base = make_layer("paddle", "bfloat16", 10)
    view = base[2:]
    ref = as_bytes(base)
    saved = ref.copy()
    bb = ref.shape[1]
    host = HostBuffer(2 * bb, pinned=False)
    swap_cache_all_layers([view], [host], 2, [0, 7], [1, 0], 0, 0)
    np.testing.assert_array_equal(host.view(np.uint8, (2, bb)), saved[[9, 2]])
    ref[...] = 0
    swap_cache_all_layers([view], [host], 2, [0, 7], [1, 0], 0, 1)
    expect = np.zeros_like(saved)
    expect[[2, 9]] = saved[[2, 9]]
    np.testing.assert_array_equal(ref, expect)


def test_duplicate_source_ids_allowed() -> None:
    # A source block may be copied to several destinations (mode 0 reads device block 3 twice).
    layers = make_layers("numpy", "uint8", 2, 6)
    bb = block_nbytes(layers[0])
    hosts = [HostBuffer(5 * bb, pinned=False) for _ in layers]
    swap_cache_all_layers(layers, hosts, 5, [3, 3, 1], [0, 4, 2], 0, 0)
    staging = HostBuffer(3 * 2 * bb, pinned=False)
    swap_cache_layout(layers, staging, [6, *BLOCK], [5, 5], [0, 2], 0, 0)
    for li, (t, h) in enumerate(zip(layers, hosts, strict=True)):
        np.testing.assert_array_equal(h.view(np.uint8, (5, bb))[[0, 4, 2]], as_bytes(t)[[3, 3, 1]])
        np.testing.assert_array_equal(
            staging.view(np.uint8, (3, 2, bb))[[0, 2], li], as_bytes(t)[[5, 5]]
        )


def test_duplicate_destination_ids_rejected() -> None:
    layers = make_layers("numpy", "uint8", 2, 6)
    hosts = [HostBuffer(5 * block_nbytes(layers[0]), pinned=False) for _ in layers]
    with pytest.raises(ValueError, match=r"host_block_ids contains duplicate destination id 4"):
        swap_cache_all_layers(layers, hosts, 5, [0, 1], [4, 4], 0, 0)
    with pytest.raises(ValueError, match=r"device_block_ids contains duplicate destination id 2"):
        swap_cache_all_layers(layers, hosts, 5, [2, 2], [0, 1], 0, 1)
    staging = HostBuffer(4 * 2 * block_nbytes(layers[0]), pinned=False)
    with pytest.raises(ValueError, match=r"staging_slot_ids contains duplicate destination id 1"):
        swap_cache_layout(layers, staging, [6, *BLOCK], [0, 2], [1, 1], 0, 0)
    with pytest.raises(ValueError, match=r"device_block_ids contains duplicate destination id 5"):
        swap_cache_layout(layers, staging, [6, *BLOCK], [5, 5], [0, 1], 0, 1)


@pytest.mark.parametrize("mode", [0, 1])
def test_empty_ids_are_a_no_op(mode: int) -> None:
    layers = make_layers("paddle", "float16", 2, 4)
    before = [as_bytes(t).copy() for t in layers]
    hosts = [HostBuffer(4 * block_nbytes(layers[0]), pinned=False) for _ in layers]
    swap_cache_all_layers(layers, hosts, 4, [], [], 0, mode)
    swap_cache_layout(layers, hosts[0], [4, *BLOCK], np.array([], np.int64), [], 0, mode)
    for t, b in zip(layers, before, strict=True):
        np.testing.assert_array_equal(as_bytes(t), b)


@pytest.mark.parametrize(
    ("dev_ids", "host_ids", "pattern"),
    [
        ([0, 6], [0, 1], r"device_block_ids\[1\]=6 out of range \[0, 6\)"),
        ([-1], [0], r"device_block_ids\[0\]=-1 out of range"),
        ([0, 1], [0, 5], r"host_block_ids\[1\]=5 out of range \[0, 5\)"),
        ([0], [-3], r"host_block_ids\[0\]=-3 out of range"),
    ],
)
@pytest.mark.parametrize("mode", [0, 1])
def test_all_layers_out_of_range(
    dev_ids: list[int], host_ids: list[int], pattern: str, mode: int
) -> None:
    layers = make_layers("numpy", "uint8", 2, 6)
    hosts = [HostBuffer(5 * block_nbytes(layers[0]), pinned=False) for _ in layers]
    before = [h.array.copy() for h in hosts]
    with pytest.raises(ValueError, match=pattern):
        swap_cache_all_layers(layers, [h.ptr for h in hosts], 5, dev_ids, host_ids, 0, mode)
    for h, b in zip(hosts, before, strict=True):  # validation happens before any byte moves
        np.testing.assert_array_equal(h.array, b)


def test_argument_errors() -> None:
    layers = make_layers("numpy", "uint8", 2, 6)
    bb = block_nbytes(layers[0])
    hosts = [HostBuffer(5 * bb, pinned=False) for _ in layers]
    with pytest.raises(ValueError, match="differ in length"):
        swap_cache_all_layers(layers, hosts, 5, [0, 1], [0], 0, 0)
    with pytest.raises(ValueError, match="host_ptrs has 1 entries"):
        swap_cache_all_layers(layers, hosts[:1], 5, [0], [0], 0, 0)
    with pytest.raises(ValueError, match=r"host_ptrs\[0\] holds"):
        swap_cache_all_layers(layers, hosts, 6, [0], [0], 0, 0)
    with pytest.raises(ValueError, match="mode must be"):
        swap_cache_all_layers(layers, hosts, 5, [0], [0], 0, 2)
    with pytest.raises(TypeError, match="must hold integers"):
        swap_cache_all_layers(layers, hosts, 5, [0.5], [0], 0, 0)
    with pytest.raises(ValueError, match="element size"):
        swap_cache_all_layers(
            [layers[0], make_layer("numpy", "float16", 6)], hosts, 5, [0], [0], 0, 0
        )
    with pytest.raises(ValueError, match="block shape"):
        swap_cache_all_layers(
            [layers[0], make_layer("numpy", "uint8", 6, (2, 16, 4))], hosts, 5, [0], [0], 0, 0
        )
    with pytest.raises(ValueError, match="cache_shape"):
        swap_cache_layout(layers, hosts[0], [6, 2, 8, 8], [0], [0], 0, 0)
    with pytest.raises(ValueError, match="non-null"):
        swap_cache_layout(layers, 0, [6, *BLOCK], [0], [0], 0, 0)


def test_non_contiguous_rejected() -> None:
    layer = make_layer("paddle", "bfloat16", 4)
    hosts = [HostBuffer(4 * block_nbytes(layer), pinned=False)]
    with pytest.raises(ValueError, match=r"cache_tensors\[0\] must be contiguous"):
        swap_cache_all_layers([layer.transpose([0, 2, 1, 3])], hosts, 4, [0], [0], 0, 0)
    arr = make_layer("numpy", "float16", 4)
    with pytest.raises(ValueError, match=r"cache_tensors\[1\] must be C-contiguous"):
        swap_cache_layout([arr, arr[:, :, ::-1]], hosts[0], [4, *BLOCK], [0], [0], 0, 0)
    with pytest.raises(ValueError, match=r"staging_ptr must be C-contiguous"):
        swap_cache_layout([arr], np.zeros((64, 64), np.uint8)[:, ::2], [4, *BLOCK], [0], [0], 0, 0)


def test_gpu_tensor_without_cuda_is_a_clear_error() -> None:
    if ops.cuda_available():
        pytest.skip("a CUDA device is present")

    class FakeGpuTensor:
        shape = (4, *BLOCK)
        is_cuda = True

        def data_ptr(self) -> int:
            return 4096

        def element_size(self) -> int:
            return 2

        def is_contiguous(self) -> bool:
            return True

    hosts = [HostBuffer(4 * math.prod(BLOCK) * 2, pinned=False)]
    with pytest.raises(RuntimeError, match="CUDA"):
        swap_cache_all_layers([FakeGpuTensor()], hosts, 4, [0], [0], 0, 0)


# --------------------------------------------------------------------------- swap_cache_layout


def check_layout_round_trip(
    layers: list[Any],
    cache_shape: list[int],
    dev_ids: list[int],
    slot_ids: list[int],
    nslots: int,
    staging: Any = None,
    **kw: Any,
) -> None:
    bb = block_nbytes(layers[0])
    nl = len(layers)
    buf = staging if staging is not None else HostBuffer(nslots * nl * bb, pinned=False)
    stage = buf.view(np.uint8, (nslots, nl, bb)) if isinstance(buf, HostBuffer) else None
    if stage is None:
        stage = as_bytes(buf).reshape(nslots, nl, bb)
    stage[...] = RNG.integers(0, 256, stage.shape, dtype=np.uint8)
    expect = stage.copy()
    dev_before = [as_bytes(t).copy() for t in layers]

    swap_cache_layout(layers, buf, cache_shape, dev_ids, slot_ids, 0, 0, **kw)
    for li, t in enumerate(layers):
        expect[slot_ids, li] = as_bytes(t)[dev_ids]
    np.testing.assert_array_equal(stage, expect)

    for t in layers:
        as_bytes(t)[...] = 0
    swap_cache_layout(layers, buf, cache_shape, dev_ids, slot_ids, 0, 1, **kw)
    for t, before in zip(layers, dev_before, strict=True):
        want = np.zeros_like(before)
        want[dev_ids] = before[dev_ids]
        np.testing.assert_array_equal(as_bytes(t), want)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_layout_round_trip(lib: str, case: str) -> None:
    for layers in tensor_sets(lib, case, nlayers=4, nblocks=10):
        dev_ids, slot_ids = random_pairs(6, 10, 9)
        shape = [10, *layers[0].shape[1:]]
        check_layout_round_trip(layers, shape, dev_ids, slot_ids, nslots=9)


def test_layout_single_layer_merged_runs() -> None:
    layers = make_layers("paddle", "bfloat16", 1, 12)
    dev_ids = [0, 1, 2, 3, 7, 8, 11, 5]
    slot_ids = [4, 5, 6, 0, 1, 2, 8, 9]
    check_layout_round_trip(layers, [12, *BLOCK], dev_ids, slot_ids, nslots=10)


def test_layout_extra_layers_with_fewer_blocks() -> None:
    main = make_layers("paddle", "bfloat16", 3, 16)
    extra = make_layers("paddle", "bfloat16", 2, 4)  # e.g. MTP layers with their own block count
    layers = main + extra
    check_layout_round_trip(layers, [16, *BLOCK], [3, 0, 2], [1, 0, 2], nslots=3)
    staging = HostBuffer(3 * 5 * block_nbytes(main[0]), pinned=False)
    with pytest.raises(
        ValueError, match=r"device_block_ids\[1\]=9 out of range \[0, 4\) of layer 3"
    ):
        swap_cache_layout(layers, staging, [16, *BLOCK], [0, 9], [0, 1], 0, 0)
    with pytest.raises(ValueError, match=r"of layer 3"):
        swap_cache_all_layers(layers, [staging] * 5, 3, [4], [0], 0, 1)
    check_all_layers_round_trip(layers, [1, 3], [0, 2], max_host=3)


def test_layout_staging_bounds() -> None:
    layers = make_layers("numpy", "uint8", 2, 6)
    bb = block_nbytes(layers[0])
    staging = HostBuffer(3 * 2 * bb + bb, pinned=False)  # 3 whole slots and a partial one
    with pytest.raises(ValueError, match=r"staging_slot_ids\[0\]=3 out of range \[0, 3\)"):
        swap_cache_layout(layers, staging, [6, *BLOCK], [0], [3], 0, 0)
    with pytest.raises(ValueError, match=r"staging_slot_ids\[0\]=-1 is negative"):
        swap_cache_layout(layers, staging.ptr, [6, *BLOCK], [0], [-1], 0, 0)
    with pytest.raises(ValueError, match=r"staging_slot_ids\[0\]=2 out of range \[0, 2\)"):
        swap_cache_layout(layers, staging.ptr, [6, *BLOCK], [0], [2], 0, 0, staging_nslots=2)
    # A raw address with no known size (as FastDeploy passes it) is accepted.
    swap_cache_layout(layers, staging.ptr, [6, *BLOCK], [5, 4], [2, 0], 0, 0)
    view = staging.view(np.uint8, (3, 2, bb))
    np.testing.assert_array_equal(view[2, 1], as_bytes(layers[1])[5])


def test_layout_staging_as_tensor() -> None:
    layers = make_layers("paddle", "float16", 2, 6)
    staging = paddle.zeros([4, 2, *BLOCK], dtype="float16")
    check_layout_round_trip(layers, [6, *BLOCK], [5, 1, 2], [3, 0, 1], nslots=4, staging=staging)


# --------------------------------------------------------------------------- HostBuffer


def test_host_buffer_alignment_views_and_lifetime() -> None:
    buf = HostBuffer(10_000, pinned=False)
    assert buf.ptr % 4096 == 0 and buf.nbytes == 10_000 and not buf.pinned
    assert buf.array.dtype == np.uint8 and buf.array.shape == (10_000,)
    f32 = buf.view(np.float32, (50, 50))
    assert f32.shape == (50, 50) and f32.ctypes.data == buf.ptr
    with pytest.raises(ValueError, match="does not fit"):
        buf.view(np.float64, (2000,))
    arr = buf.array
    buf.close()
    assert buf.closed
    with pytest.raises(ValueError, match="closed"):
        _ = buf.ptr
    del buf
    gc.collect()
    arr[:] = 7  # the memory lives as long as a view does
    assert int(f32.view(np.uint8)[0, 0]) == 7
    with HostBuffer(4096, pinned="auto") as b2:
        assert b2.pinned == ops.cuda_available()
    assert b2.closed


def test_host_buffer_pinned_requires_cuda() -> None:
    if ops.cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError):
        HostBuffer(4096, pinned=True)
    with pytest.raises(ValueError):
        HostBuffer(0, pinned=False)


class _Float8LikeTensor:
    """What torch's float8 CUDA tensors look like to kvcore: a data_ptr(), and an array
    interface property that raises KeyError (torch has no type string for float8)."""

    def __init__(self, array):
        self._array = array
        self.shape = array.shape
        self.is_cuda = False

    def data_ptr(self):
        return self._array.ctypes.data

    def element_size(self):
        return 1

    def is_contiguous(self):
        return True

    @property
    def __cuda_array_interface__(self):
        raise KeyError("torch.float8_e4m3fn")


def test_framework_tensors_are_taken_by_data_ptr_not_their_array_interface():
    """Found on an H100: every task on torch float8 caches failed with KeyError."""
    backing = np.arange(4 * 2 * 8, dtype=np.uint8).reshape(4, 2, 8)
    t = _Float8LikeTensor(backing)
    assert ops.describe_tensor(t, "k[0]") == (backing.ctypes.data, (4, 2, 8), 1, False)
    host = np.zeros(2 * 2 * 8, dtype=np.uint8)
    ops.swap_cache_layout([t], host, [4, 2, 8], [3, 1], [0, 1], 0, ops.TO_HOST)
    assert host.tobytes() == backing[[3, 1]].tobytes()
