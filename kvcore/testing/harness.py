"""Drive an opened backend with real buffers and known bytes, whatever its I/O kind.

The harness hides the difference between host-I/O backends (staging regions per block and
part) and device-I/O backends (per-layer cache arrays and block ids): tests speak in
"sequences" of blocks and compare canonical payloads ``[block, part] -> bytes``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np
from typing_extensions import Unpack

from kvcore.backend import Backend
from kvcore.keys import KeyScope, block_hashes
from kvcore.requests import BlockRequest, DeviceBuffers, HostBuffers
from kvcore.schemas import CacheLayout

__all__ = ["Harness", "HostRegion", "Sequence_", "payload_for"]


class _RequestOptions(TypedDict, total=False):
    """What the request builders pass on to :meth:`Harness.request` (they make the buffers)."""

    timeout_s: float | None
    block_meta: Sequence[bytes] | None
    tenant: str | None


class _Buffers(TypedDict, total=False):
    """A request's buffers, as :meth:`Harness.request` takes them: host or device."""

    host: HostBuffers
    device: DeviceBuffers


_Extract = Callable[[], list[list[bytes]]]


def payload_for(key: str, part: str, nbytes: int, version: int = 0) -> np.ndarray:
    """Deterministic pseudo-random bytes for one object (differ per key, part and version)."""
    seed = int.from_bytes(
        hashlib.sha256(f"{key}|{part}|{version}".encode("utf-8", "surrogatepass")).digest()[:8],
        "little",
    )
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@dataclass
class Sequence_:
    """A token sequence and its block keys (the name avoids shadowing typing.Sequence)."""

    token_ids: list[int]
    keys: list[str]


@dataclass
class HostRegion:
    """One contiguous host allocation holding ``num_blocks`` blocks, all parts of a block
    side by side: what an engine's staging pool looks like to ``kvcore_register_buffer``."""

    array: np.ndarray
    part_nbytes: tuple[int, ...]
    num_blocks: int

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def host(self, first: int = 0, n: int | None = None) -> HostBuffers:
        """Buffers for ``n`` blocks starting at the region's block ``first``."""
        n = self.num_blocks - first if n is None else n
        if first < 0 or first + n > self.num_blocks:
            raise ValueError(
                f"blocks {first}..{first + n} are outside a {self.num_blocks}-block region"
            )
        block = sum(self.part_nbytes)
        offsets = np.cumsum((0, *self.part_nbytes[:-1]), dtype=np.int64)
        starts = self.ptr + (first + np.arange(n, dtype=np.int64)) * block
        # built with numpy: bulk requests of tens of thousands of blocks stay cheap
        ptrs = tuple(map(tuple, (starts[:, None] + offsets[None, :]).tolist()))
        return HostBuffers(ptrs=ptrs, nbytes=self.part_nbytes)

    def blocks(self, first: int = 0, n: int | None = None) -> list[list[bytes]]:
        """The bytes of blocks ``first .. first + n``, ``[block][part]``."""
        n = self.num_blocks - first if n is None else n
        block = sum(self.part_nbytes)
        out = []
        for i in range(first, first + n):
            at = i * block
            parts = []
            for size in self.part_nbytes:
                parts.append(self.array[at : at + size].tobytes())
                at += size
            out.append(parts)
        return out


@dataclass
class Harness:
    backend: Backend
    layout: CacheLayout
    timeout_s: float = 10.0
    #: the per-part layer arrays and block ids of the last device-I/O request built
    last_device: tuple[dict[str, list[np.ndarray]], list[int]] | None = None
    _keep: list[object] = field(default_factory=list)

    @property
    def io(self) -> str:
        return self.backend.capabilities.io

    @property
    def parts(self) -> tuple[str, ...]:
        return self.layout.parts

    # -- sequences -------------------------------------------------------------------------

    def new_sequence(self, num_blocks: int, *, extra_tokens: int = 0) -> Sequence_:
        """Fresh random tokens (unique per call, so shared stores never collide)."""
        scope = KeyScope(namespace=f"kvcore-conformance-{uuid.uuid4().hex}")
        rng = np.random.default_rng()
        n_tokens = num_blocks * self.layout.block_size + extra_tokens
        tokens = rng.integers(0, 150_000, n_tokens).tolist()
        return Sequence_(tokens, block_hashes(tokens, self.layout.block_size, scope))

    # -- requests --------------------------------------------------------------------------

    def request(
        self,
        seq: Sequence_,
        start: int = 0,
        n: int | None = None,
        *,
        timeout_s: float | None = None,
        host: HostBuffers | None = None,
        device: DeviceBuffers | None = None,
        block_meta: Sequence[bytes] | None = None,
        tenant: str | None = None,
    ) -> BlockRequest:
        n = len(seq.keys) - start if n is None else n
        return self.backend.request(
            f"conformance-{uuid.uuid4().hex[:8]}",
            seq.keys[start : start + n],
            start_block=start,
            token_ids=seq.token_ids,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            host=host,
            device=device,
            block_meta=block_meta,
            tenant=tenant,
        )

    def query(
        self, seq: Sequence_, start: int = 0, n: int | None = None, **kw: Unpack[_RequestOptions]
    ) -> int:
        return self.backend.query(self.request(seq, start, n, **kw))

    def write(
        self,
        seq: Sequence_,
        start: int = 0,
        n: int | None = None,
        *,
        version: int = 0,
        **kw: Unpack[_RequestOptions],
    ) -> int:
        n = len(seq.keys) - start if n is None else n
        payload = self.payload(seq, start, n, version)
        buffers = self._buffers_holding(payload)
        return self.backend.write(self.request(seq, start, n, **buffers, **kw))

    def read(
        self, seq: Sequence_, start: int = 0, n: int | None = None, **kw: Unpack[_RequestOptions]
    ) -> tuple[int, list[list[bytes]]]:
        """Read blocks; return the count and what landed in the buffers (all ``n`` blocks)."""
        n = len(seq.keys) - start if n is None else n
        buffers, extract = self._empty_buffers(n)
        done = self.backend.read(self.request(seq, start, n, **buffers, **kw))
        return done, extract()

    def assert_reads_back(self, seq: Sequence_, stored: int, *, version: int = 0) -> None:
        """Read all of ``seq`` and assert that exactly its first ``stored`` blocks come back,
        byte for byte as written (with ``version``).

        .. versionadded:: 0.2
        """
        done, got = self.read(seq)
        assert done == stored, f"read {done} blocks where {stored} are stored"
        wrong = blocks_equal(got[:stored], self.payload(seq, 0, stored, version))
        assert wrong == [], f"blocks {wrong} came back with other bytes than were written"

    def write_request(
        self,
        seq: Sequence_,
        start: int = 0,
        n: int | None = None,
        *,
        version: int = 0,
        **kw: Unpack[_RequestOptions],
    ) -> BlockRequest:
        """A write request whose buffers hold the blocks' payloads (kept alive until
        :meth:`release`), for tests that time or alter the call itself."""
        n = len(seq.keys) - start if n is None else n
        buffers = self._buffers_holding(self.payload(seq, start, n, version))
        return self.request(seq, start, n, **buffers, **kw)

    def read_request(
        self, seq: Sequence_, start: int = 0, n: int | None = None, **kw: Unpack[_RequestOptions]
    ) -> tuple[BlockRequest, Callable[[], list[list[bytes]]]]:
        """A read request into zeroed buffers, and a function returning what landed there."""
        n = len(seq.keys) - start if n is None else n
        buffers, extract = self._empty_buffers(n)
        return self.request(seq, start, n, **buffers, **kw), extract

    def bulk_request(
        self, seq: Sequence_, start: int = 0, n: int | None = None, **kw: Unpack[_RequestOptions]
    ) -> BlockRequest:
        """A request whose buffers hold arbitrary bytes, built in bulk: for timing large
        batches, where per-object payloads would cost more than the call measured."""
        n = len(seq.keys) - start if n is None else n
        if self.io == "host":
            sizes = tuple(self.layout.part_bytes(p) for p in self.parts)
            region = HostRegion(_noise(max(n, 1) * sum(sizes)), sizes, max(n, 1))
            self._keep.append(region)
            return self.request(seq, start, n, host=region.host(0, n), **kw)
        buffers, _ = self._device_buffers(n, None)
        # never None here: _device_buffers has just set it
        tensors, block_ids = self.last_device  # type: ignore[misc]
        rows = np.asarray(block_ids, dtype=np.int64)
        for arrays in tensors.values():
            for array in arrays:
                # only the blocks the request names: the tensors hold the whole layout
                width = array.shape[1]
                array[rows] = _noise(len(rows) * width).reshape(len(rows), width)
        return self.request(seq, start, n, **buffers, **kw)

    def segmented(
        self, n: int, fill: list[list[bytes]] | None = None
    ) -> tuple[HostBuffers, Callable[[], list[list[bytes]]]]:
        """Segmented host buffers (``Capabilities.segmented_host``) for ``n`` blocks: each
        object is one segment per layer in per-layer arrays, as in an engine's host-resident
        cache; returns the buffers and a function returning the objects' bytes."""
        _, extract = self._device_buffers(n, fill)
        # never None here: _device_buffers has just set it
        tensors, block_ids = self.last_device  # type: ignore[misc]
        host = HostBuffers(
            ptrs=(),
            nbytes=tuple(self.layout.part_bytes(p) for p in self.parts),
            layer_ptrs=tuple(tuple(t.ctypes.data for t in tensors[p]) for p in self.parts),
            block_ids=tuple(block_ids),
            segment_nbytes=tuple(self.layout.layer_block_bytes(p) for p in self.parts),
        )
        return host, extract

    def region(self, num_blocks: int, fill: list[list[bytes]] | None = None) -> HostRegion:
        """A contiguous host region for ``num_blocks`` blocks (kept alive until
        :meth:`release`), optionally holding ``fill`` (``[block][part]`` bytes)."""
        sizes = tuple(self.layout.part_bytes(p) for p in self.parts)
        block = sum(sizes)
        array = np.zeros(max(num_blocks, 1) * block, dtype=np.uint8)
        for i, parts in enumerate(fill or []):
            at = i * block
            for data in parts:
                array[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
                at += len(data)
        region = HostRegion(array, sizes, num_blocks)
        self._keep.append(region)
        return region

    # -- payloads and buffers --------------------------------------------------------------

    def payload(self, seq: Sequence_, start: int, n: int, version: int = 0) -> list[list[bytes]]:
        return [
            [
                payload_for(seq.keys[i], p, self.layout.part_bytes(p), version).tobytes()
                for p in self.parts
            ]
            for i in range(start, start + n)
        ]

    def _buffers_holding(self, payload: list[list[bytes]]) -> _Buffers:
        buffers, _ = self._empty_buffers(len(payload), payload)
        return buffers

    def _empty_buffers(
        self, n: int, fill: list[list[bytes]] | None = None
    ) -> tuple[_Buffers, _Extract]:
        if self.io == "host":
            return self._host_buffers(n, fill)
        return self._device_buffers(n, fill)

    def _host_buffers(self, n: int, fill: list[list[bytes]] | None) -> tuple[_Buffers, _Extract]:
        sizes = tuple(self.layout.part_bytes(p) for p in self.parts)
        arrays = [np.zeros((max(n, 1), s), dtype=np.uint8) for s in sizes]
        if fill is not None:
            for i, block in enumerate(fill):
                for j, data in enumerate(block):
                    arrays[j][i] = np.frombuffer(data, dtype=np.uint8)
        self._keep.append(arrays)
        ptrs = tuple(
            tuple(arrays[j].ctypes.data + i * sizes[j] for j in range(len(sizes))) for i in range(n)
        )

        def extract() -> list[list[bytes]]:
            return [[arrays[j][i].tobytes() for j in range(len(sizes))] for i in range(n)]

        return {"host": HostBuffers(ptrs=ptrs, nbytes=sizes)}, extract

    def _device_buffers(self, n: int, fill: list[list[bytes]] | None) -> tuple[_Buffers, _Extract]:
        lay = self.layout
        usable = min(lay.layer_num_blocks(layer) for layer in range(lay.total_layers))
        if n > usable:
            raise ValueError(f"layout has {usable} device blocks, test needs {n}")
        rng = np.random.default_rng()
        block_ids = rng.permutation(usable)[:n].tolist()
        tensors: dict[str, list[np.ndarray]] = {}
        for p in self.parts:
            per_block = lay.layer_block_bytes(p)
            tensors[p] = [
                np.zeros((lay.layer_num_blocks(layer), per_block), dtype=np.uint8)
                for layer in range(lay.total_layers)
            ]
        if fill is not None:
            for i, block in enumerate(fill):
                for j, p in enumerate(self.parts):
                    per_layer = np.frombuffer(block[j], dtype=np.uint8).reshape(
                        lay.total_layers, -1
                    )
                    for layer in range(lay.total_layers):
                        tensors[p][layer][block_ids[i]] = per_layer[layer]
        self._keep.append(tensors)

        def ptrs(p: str) -> tuple[int, ...]:
            return tuple(t.ctypes.data for t in tensors.get(p, []))

        device = DeviceBuffers(
            layout=lay,
            layer_ids=tuple(range(lay.total_layers)),
            k_ptrs=ptrs("k"),
            v_ptrs=ptrs("v"),
            k_scale_ptrs=ptrs("k_scale"),
            v_scale_ptrs=ptrs("v_scale"),
            block_ids=tuple(block_ids),
        )

        def extract() -> list[list[bytes]]:
            return [
                [
                    b"".join(
                        tensors[p][layer][block_ids[i]].tobytes()
                        for layer in range(lay.total_layers)
                    )
                    for p in self.parts
                ]
                for i in range(n)
            ]

        self.last_device = (tensors, block_ids)
        return {"device": device}, extract

    def release(self) -> None:
        self._keep.clear()


_NOISE_TILE = np.random.default_rng(20261122).integers(0, 256, 1 << 20, dtype=np.uint8)


def _noise(nbytes: int) -> np.ndarray:
    """``nbytes`` of incompressible-looking bytes, fast: a random MiB repeated."""
    return np.resize(_NOISE_TILE, nbytes)


def blocks_equal(got: Sequence[Sequence[bytes]], want: Sequence[Sequence[bytes]]) -> list[int]:
    """Indices of blocks whose parts differ (empty when all equal)."""
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if list(g) != list(w)]
