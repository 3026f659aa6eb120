"""kvcore.fileio: native whole-file reads into the caller's memory, checked against what Python's
own system calls and xxhash give for the same files."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading

import numpy as np
import pytest
import xxhash

from kvcore import fileio
from kvcore.fileio import FileRead

PAGE = 4096
#: a kvcore built without xxhash's header reads and writes natively but computes no digest
needs_digests = pytest.mark.skipif(
    not fileio.NATIVE_DIGESTS, reason="kvcore was built without xxhash.h (libxxhash-dev)"
)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _expected_digest(prefix: bytes, payload: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(prefix)
    h.update(struct.pack("<Q", len(payload)))
    h.update(payload)
    return h.digest()


def _drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@needs_digests
def test_a_file_fills_the_head_and_every_piece_in_order_with_its_digest(tmp_path) -> None:
    head_bytes, payload = os.urandom(100), os.urandom(3 * PAGE + 7)
    path = str(tmp_path / "f")
    _write(path, head_bytes + payload)
    head = bytearray(100)
    sizes = [PAGE, 0, 2 * PAGE, 7]  # an empty piece too
    pieces = [memoryview(bytearray(n)) for n in sizes]
    code, err, direct, digest = fileio.read_file(path, head, pieces, digest_prefix=b"name")
    assert (code, err, direct) == (FileRead.OK, 0, False)
    assert bytes(head) == head_bytes
    assert b"".join(bytes(p) for p in pieces) == payload
    assert digest == _expected_digest(b"name", payload)
    assert fileio.read_file(path, head, pieces)[3] is None  # no prefix: no digest


@needs_digests
def test_more_pieces_than_one_system_call_takes(tmp_path) -> None:
    """Linux takes 1024 iovecs a call: 1500 pieces need two reads, in order."""
    payload = os.urandom(1500 * 64)
    path = str(tmp_path / "f")
    _write(path, b"h" * 8 + payload)
    pieces = [memoryview(bytearray(64)) for _ in range(1500)]
    code, _, _, digest = fileio.read_file(path, bytearray(8), pieces, digest_prefix=b"")
    assert code == FileRead.OK
    assert b"".join(bytes(p) for p in pieces) == payload
    assert digest == _expected_digest(b"", payload)


def test_what_is_not_the_file_asked_for_is_told_apart(tmp_path) -> None:
    head, piece = bytearray(8), memoryview(bytearray(8))
    missing = str(tmp_path / "missing")
    assert fileio.read_file(missing, head, [piece])[0] == FileRead.MISSING
    short = str(tmp_path / "short")
    _write(short, b"x" * 15)
    assert fileio.read_file(short, head, [piece])[0] == FileRead.OTHER
    longer = str(tmp_path / "long")
    _write(longer, b"x" * 17)
    assert fileio.read_file(longer, head, [piece])[0] == FileRead.OTHER
    os.mkdir(tmp_path / "dir")
    assert fileio.read_file(str(tmp_path / "dir"), head, [piece])[0] == FileRead.OTHER
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)  # opened without blocking: no writer is waited for
    assert fileio.read_file(fifo, head, [piece])[0] == FileRead.OTHER
    good = str(tmp_path / "good")
    _write(good, b"y" * 16)
    os.symlink(good, tmp_path / "link")
    assert fileio.read_file(str(tmp_path / "link"), head, [piece])[0] == FileRead.OTHER


def test_memory_the_kernel_cannot_write_is_an_os_error_not_a_short_file(tmp_path) -> None:
    """An engine's bad pointer: the read stops with EFAULT, reported as such (a caller that
    took it for a short file would remove a good object)."""
    path = str(tmp_path / "f")
    _write(path, b"h" * 8 + os.urandom(2 * PAGE))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    prot_none, private_anonymous = 0, 0x02 | 0x20
    address = libc.mmap(None, PAGE, prot_none, private_anonymous, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    try:
        forbidden = memoryview((ctypes.c_char * PAGE).from_address(address)).cast("B")
        good = memoryview(bytearray(PAGE))
        code, err, _, _ = fileio.read_file(path, bytearray(8), [good, forbidden])
        assert (code, err) == (FileRead.ERRNO, 14)  # EFAULT
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(PAGE))


@needs_digests
def test_a_file_the_page_cache_does_not_hold_is_read_around_it(tmp_path) -> None:
    payload = os.urandom(8 * PAGE)
    path = str(tmp_path / "f")
    _write(path, b"H" * PAGE + payload)
    region = mmap.mmap(-1, 8 * PAGE)  # page-aligned, as staging and cache blocks are
    head = bytearray(PAGE)  # the head buffer need not be aligned
    _drop_from_page_cache(path)
    code, _, direct, digest = fileio.read_file(
        path, head, [memoryview(region)], direct=True, digest_prefix=b"n"
    )
    if code == FileRead.DIRECT_REFUSED:
        pytest.skip("this file system or kernel refuses O_DIRECT or cachestat(2)")
    assert (code, direct) == (FileRead.OK, True)
    assert bytes(head) == b"H" * PAGE and bytes(region) == payload
    assert digest == _expected_digest(b"n", payload)
    with open(path, "rb") as f:  # cached now: through the page cache
        f.read()
    assert fileio.read_file(path, head, [memoryview(region)], direct=True)[:3] == (0, 0, False)
    _drop_from_page_cache(path)  # cold, but a piece is not page-aligned: through the cache
    unaligned = [memoryview(region)[: 4 * PAGE], memoryview(bytearray(4 * PAGE))]
    code, _, direct, _ = fileio.read_file(path, head, unaligned, direct=True)
    assert (code, direct) == (FileRead.OK, False)


def test_buffers_it_cannot_write_are_refused_by_name(tmp_path) -> None:
    path = str(tmp_path / "f")
    _write(path, b"x" * 16)
    with pytest.raises(TypeError, match="head"):
        fileio.read_file(path, bytes(8), [memoryview(bytearray(8))])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="piece"):
        fileio.read_file(path, bytearray(8), [memoryview(b"x" * 8)])


@needs_digests
def test_a_write_lands_whole_under_its_name_with_the_digest_in_its_head(tmp_path) -> None:
    payload = [os.urandom(PAGE), b"", os.urandom(100)]
    head = bytearray(64)
    head[:4] = b"HEAD"
    temp, path = str(tmp_path / "f.tmp"), str(tmp_path / "f")
    assert fileio.write_file(temp, path, head, payload, digest_offset=8, digest_prefix=b"p") == 0
    assert not os.path.exists(temp)
    digest = _expected_digest(b"p", b"".join(payload))
    assert head[8:24] == digest
    with open(path, "rb") as f:
        assert f.read() == bytes(head) + b"".join(payload)
    assert os.stat(path).st_mode & 0o777 == 0o600
    # what read_file computes for the file is what write_file put in its head
    back = [memoryview(bytearray(len(p))) for p in payload]
    got = fileio.read_file(path, bytearray(64), back, digest_prefix=b"p")
    assert got[0] == FileRead.OK and got[3] == digest
    # synced, no digest: the bytes as given
    assert fileio.write_file(temp, path, bytearray(b"plain"), [b"x"], sync=True) == 0
    with open(path, "rb") as f:
        assert f.read() == b"plainx"


def test_a_failed_write_leaves_no_temp_file_and_says_why(tmp_path) -> None:
    temp = str(tmp_path / "t.tmp")
    missing_dir = str(tmp_path / "no" / "f")
    assert fileio.write_file(temp, missing_dir, bytearray(8), [b"x"]) == 2  # ENOENT: rename
    assert not os.path.exists(temp)
    _write(temp, b"someone else's")
    assert fileio.write_file(temp, str(tmp_path / "f"), bytearray(8), [b"x"]) == 17  # EEXIST
    with open(temp, "rb") as f:
        assert f.read() == b"someone else's"  # not ours: left alone


def test_without_native_digests_reads_still_run_natively_and_return_none(tmp_path) -> None:
    path = str(tmp_path / "f")
    _write(path, b"h" * 8 + b"p" * 8)
    piece = memoryview(bytearray(8))
    code, _, _, digest = fileio.read_file(path, bytearray(8), [piece], digest_prefix=b"n")
    assert code == FileRead.OK and bytes(piece) == b"p" * 8
    assert (digest is not None) == fileio.NATIVE_DIGESTS


@needs_digests
@pytest.mark.parametrize("direct", [False, True], ids=["cached", "direct"])
def test_payloads_of_many_windows_read_and_write_whole_with_their_digest(tmp_path, direct) -> None:
    """Payloads larger than the 256 KiB a native call moves and hashes at a time, cut at odd
    places (a window ending inside a piece, empty pieces, more pieces than one system call
    takes): the bytes and the digest are those of the whole payload, read and written."""
    sizes = [3 * 256 * 1024 + 13, 0, 7, 256 * 1024, 1, *([PAGE] * 1100), 0, 99_999]
    if direct:
        sizes = [256 * 1024 * 3, *([PAGE] * 1100), 2 * 256 * 1024]  # O_DIRECT: pages only
    payload = os.urandom(sum(sizes))
    head_len = PAGE if direct else 333
    head_bytes = os.urandom(head_len)
    path = str(tmp_path / "f")
    _write(path, head_bytes + payload)
    if direct:
        _drop_from_page_cache(path)
    buffers = [mmap.mmap(-1, max(n, PAGE)) for n in sizes]  # page-aligned
    pieces = [memoryview(b)[:n] for b, n in zip(buffers, sizes, strict=True)]
    head = bytearray(head_len)
    code, _, used_direct, digest = fileio.read_file(
        path, head, pieces, direct=direct, digest_prefix=b"n"
    )
    assert code == FileRead.OK
    assert bytes(head) == head_bytes and b"".join(bytes(p) for p in pieces) == payload
    assert digest == _expected_digest(b"n", payload)
    out = str(tmp_path / "g")
    head_out = bytearray(head_len)
    assert fileio.write_file(str(tmp_path / "g.tmp"), out, head_out, pieces,
                             digest_offset=16, digest_prefix=b"n") == 0  # fmt: skip
    with open(out, "rb") as f:
        written = f.read()
    assert written[16:32] == _expected_digest(b"n", payload)
    assert written[head_len:] == payload and len(written) == head_len + len(payload)
    if direct and not used_direct:
        pytest.skip("this file system read the file through the page cache")


# -- batches -------------------------------------------------------------------------------


def _rows(buffers: list[bytearray]) -> tuple[list[memoryview], np.ndarray]:
    """Pieces over ``buffers`` as a batch takes them: one ``(address, nbytes)`` row each."""

    views = [memoryview(b) for b in buffers]
    rows = np.array(
        [(ctypes.addressof(ctypes.c_char.from_buffer(b)), len(b)) for b in buffers],
        dtype=np.int64,
    ).reshape(-1, 2)
    return views, rows


def _run(batch: fileio.FileBatch, threads: int = 3):
    workers = [threading.Thread(target=batch.run) for _ in range(threads - 1)]
    for w in workers:
        w.start()
    batch.run()
    for w in workers:
        w.join()
    return batch.results()


@needs_digests
@pytest.mark.parametrize("threads", [1, 3])
def test_a_write_batch_then_a_read_batch_give_back_every_object_verified(tmp_path, threads):
    """Each object of a write batch lands whole (head, zeros, payload; the digest in its
    head), and a read batch finds each one OK, its pieces filled, from several threads."""

    n, head_len = 40, PAGE
    payloads = [bytearray(os.urandom(PAGE + 17 * k)) for k in range(n)]
    names = [f"obj-{k}".encode() for k in range(n)]
    heads = [b"HEAD" + bytes(20) + name for name in names]  # the digest at 4 .. 20
    paths = [str(tmp_path / f"{k}.kv") for k in range(n)]
    _, rows = _rows(payloads)
    starts = np.arange(n + 1, dtype=np.int64)
    lens = np.full(n, head_len, dtype=np.int64)
    batch = fileio.write_batch(
        [p + ".tmp" for p in paths], paths, heads, lens, rows, starts,
        digest_prefixes=names, digest_offset=4,
    )  # fmt: skip
    codes, errnos, _, _ = _run(batch, threads)
    assert codes.tolist() == [FileRead.OK] * n and errnos.tolist() == [0] * n
    for k in range(n):
        with open(paths[k], "rb") as f:
            data = f.read()
        digest = _expected_digest(names[k], bytes(payloads[k]))
        assert data[:4] == b"HEAD" and data[4:20] == digest
        assert data[20 : 24 + len(names[k])] == bytes(4) + names[k]
        assert data[24 + len(names[k]) : head_len] == bytes(head_len - 24 - len(names[k]))
        assert data[head_len:] == payloads[k]
        assert not os.path.exists(paths[k] + ".tmp")
    back = [bytearray(len(p)) for p in payloads]
    _, back_rows = _rows(back)
    mask = bytes([1] * 4 + [0] * 16)  # the head as written but its digest
    reads = fileio.read_batch(
        paths, heads, lens, back_rows, starts, digest_prefixes=names, digest_offset=4,
        compare_mask=mask,
    )  # fmt: skip
    codes, _, direct_reads, refused = _run(reads, threads)
    assert codes.tolist() == [FileRead.OK] * n and direct_reads == 0 and refused == 0
    assert back == payloads


@needs_digests
def test_a_read_batch_tells_what_it_cannot_settle_and_stops_at_a_failed_group(tmp_path):
    """A file whose head differs under the mask, or whose payload does not match its digest,
    is MISMATCH (the caller looks at it) and stops nothing; a missing file stops the objects
    of its group and the later groups (SKIPPED); a wrong size is OTHER."""

    n = 8
    payloads = [bytearray(os.urandom(PAGE)) for _ in range(n)]
    names = [f"n{k}".encode() for k in range(n)]
    heads = [b"HEAD" + bytes(16) + name for name in names]
    paths = [str(tmp_path / f"{k}") for k in range(n)]
    _, rows = _rows(payloads)
    starts = np.arange(n + 1, dtype=np.int64)
    lens = np.full(n, PAGE, dtype=np.int64)
    codes, _, _, _ = _run(fileio.write_batch(
        [p + ".t" for p in paths], paths, heads, lens, rows, starts, digest_prefixes=names,
        digest_offset=4,
    ))  # fmt: skip
    assert (codes == FileRead.OK).all()
    with open(paths[1], "r+b") as f:  # another name in the head
        f.seek(20)
        f.write(b"X")
    with open(paths[2], "r+b") as f:  # one payload bit flipped
        f.seek(PAGE + 5)
        byte = f.read(1)
        f.seek(PAGE + 5)
        f.write(bytes([byte[0] ^ 1]))
    with open(paths[3], "ab") as f:  # longer than the object
        f.write(b"!")
    os.unlink(paths[5])  # groups: (0, 1) (2, 3) (4, 5) (6, 7)
    back = [bytearray(PAGE) for _ in range(n)]
    _, back_rows = _rows(back)
    reads = fileio.read_batch(
        paths, heads, lens, back_rows, starts, digest_prefixes=names, digest_offset=4,
        compare_mask=bytes([1] * 4 + [0] * 16),
        group_starts=np.array([0, 0, 2, 2, 4, 4, 6, 6]),
    )  # fmt: skip
    codes, _, _, _ = _run(reads, threads=1)  # one thread: the order is the objects'
    assert codes.tolist() == [
        FileRead.OK, FileRead.MISMATCH, FileRead.MISMATCH, FileRead.OTHER,
        FileRead.OK, FileRead.MISSING, FileRead.SKIPPED, FileRead.SKIPPED,
    ]  # fmt: skip
    assert back[0] == payloads[0] and back[4] == payloads[4]
    # past the deadline nothing starts
    late = fileio.read_batch(
        paths, heads, lens, back_rows, starts, digest_prefixes=names, digest_offset=4,
        deadline=0.0,
    )  # fmt: skip
    codes, _, _, _ = _run(late, threads=1)
    assert codes.tolist()[0] == FileRead.DEADLINE
    assert set(codes.tolist()[1:]) <= {FileRead.DEADLINE, FileRead.SKIPPED}


def test_a_write_batch_reports_each_failure_and_stops_later_groups(tmp_path):

    payloads = [bytearray(b"x" * 10) for _ in range(4)]
    _, rows = _rows(payloads)
    paths = [str(tmp_path / "a"), str(tmp_path / "missing" / "b"), str(tmp_path / "c"),
             str(tmp_path / "d")]  # fmt: skip
    temps = [str(tmp_path / f"t{k}") for k in range(4)]
    batch = fileio.write_batch(
        temps, paths, [b"h"] * 4, np.full(4, 8, dtype=np.int64), rows,
        np.arange(5, dtype=np.int64), digest_prefixes=[b""] * 4, digest_offset=None,
        group_starts=np.array([0, 1, 2, 2]),
    )  # fmt: skip
    codes, errnos, _, _ = _run(batch, threads=1)
    assert codes.tolist() == [FileRead.OK, FileRead.ERRNO, FileRead.SKIPPED, FileRead.SKIPPED]
    assert errnos.tolist()[1] == 2  # ENOENT (the rename)
    with open(paths[0], "rb") as f:
        assert f.read() == b"h" + bytes(7) + b"x" * 10
    assert not any(os.path.exists(t) for t in temps)


@needs_digests
@pytest.mark.parametrize("threads", [1, 3])
def test_a_stamped_write_batch_writes_each_group_whole_under_one_stamp(tmp_path, threads):
    """``stamp_groups``: every object of a group carries XXH3-64 of the group's digests in
    order in its head's last 8 bytes; in a group where one object failed, none is renamed
    (ECANCELED), and the later groups are not started."""
    n, head_len = 9, PAGE
    payloads = [bytearray(os.urandom(300_000 + 4096 * k)) for k in range(n)]  # > one window
    names = [f"obj-{k}".encode() for k in range(n)]
    heads = [b"HEAD" + bytes(16) + name for name in names]
    paths = [str(tmp_path / f"{k}.kv") for k in range(n)]
    paths[4] = str(tmp_path / "missing" / "4.kv")  # its rename fails: group (3, 4, 5)
    _, rows = _rows(payloads)
    groups = np.array([0, 0, 0, 3, 3, 3, 6, 6, 6])
    batch = fileio.write_batch(
        [str(tmp_path / f"{k}.tmp") for k in range(n)], paths, heads,
        np.full(n, head_len, dtype=np.int64), rows, np.arange(n + 1, dtype=np.int64),
        digest_prefixes=names, digest_offset=4, group_starts=groups, stamp_groups=True,
    )  # fmt: skip
    codes, errnos, _, _ = _run(batch, threads)
    assert codes.tolist()[:3] == [FileRead.OK] * 3
    # the group of the failed rename: renamed in order up to it, the rest abandoned
    assert codes.tolist()[3:6] == [FileRead.OK, FileRead.ERRNO, FileRead.ERRNO]
    assert errnos.tolist()[4:6] == [2, 125]  # ENOENT, ECANCELED
    assert not os.path.exists(paths[5])
    if threads == 1:  # with more, a later group may have been written before the failure
        assert codes.tolist()[6:] == [FileRead.SKIPPED] * 3
    digests = []
    for k in range(3):
        with open(paths[k], "rb") as f:
            data = f.read()
        digests.append(_expected_digest(names[k], bytes(payloads[k])))
        assert data[:4] == b"HEAD" and data[4:20] == digests[k]
        assert data[head_len:] == payloads[k]
    stamp = struct.pack("<Q", xxhash.xxh3_64_intdigest(b"".join(digests)))
    for k in range(3):
        with open(paths[k], "rb") as f:
            assert f.read(head_len)[-8:] == stamp
    assert not any(p.endswith(".tmp") for p in os.listdir(tmp_path))


@needs_digests
def test_a_stamped_group_with_a_failed_payload_renames_none_of_its_objects(tmp_path):
    payloads = [bytearray(os.urandom(5000)) for _ in range(3)]
    _, rows = _rows(payloads)
    paths = [str(tmp_path / f"{k}") for k in range(3)]
    temps = [str(tmp_path / "t0"), str(tmp_path / "no-dir" / "t1"), str(tmp_path / "t2")]
    batch = fileio.write_batch(
        temps, paths, [b"h"] * 3, np.full(3, PAGE, dtype=np.int64), rows,
        np.arange(4, dtype=np.int64), digest_prefixes=[b"a", b"b", b"c"], digest_offset=8,
        group_starts=np.array([0, 0, 0]), stamp_groups=True,
    )  # fmt: skip
    codes, errnos, _, _ = _run(batch, threads=1)
    # one thread, in order: the first written, the second failed, the third not started
    assert codes.tolist() == [FileRead.ERRNO, FileRead.ERRNO, FileRead.SKIPPED]
    assert errnos.tolist() == [125, 2, 0]  # ECANCELED, ENOENT (its temp)
    assert os.listdir(tmp_path) == [], "a part of a failed group was left"


def test_a_batch_refuses_bad_arguments_naming_them(tmp_path):

    rows = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(ValueError, match="head_lens"):
        fileio.read_batch([str(tmp_path / "a")], [b""], np.zeros(2, dtype=np.int64), rows,
                          np.array([0, 1]), digest_prefixes=[b""], digest_offset=None)  # fmt: skip
    with pytest.raises(ValueError, match="iov_starts out of range"):
        fileio.read_batch([str(tmp_path / "a")], [b""], np.zeros(1, dtype=np.int64), rows,
                          np.array([0, 2]), digest_prefixes=[b""], digest_offset=None)  # fmt: skip
    with pytest.raises(ValueError, match="group_starts"):
        fileio.read_batch([str(tmp_path / "a")], [b""], np.zeros(1, dtype=np.int64), rows,
                          np.array([0, 1]), digest_prefixes=[b""], digest_offset=None,
                          group_starts=np.array([1]))  # fmt: skip
    with pytest.raises(TypeError, match="prefix must be bytes"):
        fileio.read_batch([str(tmp_path / "a")], [b""], np.zeros(1, dtype=np.int64), rows,
                          np.array([0, 1]), digest_prefixes=["s"], digest_offset=None)  # type: ignore[list-item]  # fmt: skip
