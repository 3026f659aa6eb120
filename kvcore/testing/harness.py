"""Drive an opened backend with real buffers and known bytes, whatever its I/O kind.

The harness hides the difference between host-I/O backends (staging regions per block and
part) and device-I/O backends (per-layer cache arrays and block ids): tests speak in
"sequences" of blocks and compare canonical payloads ``[block, part] -> bytes``.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcore.backend import Backend
from kvcore.keys import KeyScope, block_hashes
from kvcore.requests import BlockRequest, DeviceBuffers, HostBuffers
from kvcore.schemas import CacheLayout

__all__ = ["Harness", "Sequence_", "payload_for"]


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
        )

    def query(self, seq: Sequence_, start: int = 0, n: int | None = None, **kw) -> int:
        return self.backend.query(self.request(seq, start, n, **kw))

    def write(
        self, seq: Sequence_, start: int = 0, n: int | None = None, *, version: int = 0, **kw
    ) -> int:
        n = len(seq.keys) - start if n is None else n
        payload = self.payload(seq, start, n, version)
        buffers = self._buffers_holding(payload)
        return self.backend.write(self.request(seq, start, n, **buffers, **kw))

    def read(
        self, seq: Sequence_, start: int = 0, n: int | None = None, **kw
    ) -> tuple[int, list[list[bytes]]]:
        """Read blocks; return the count and what landed in the buffers (all ``n`` blocks)."""
        n = len(seq.keys) - start if n is None else n
        buffers, extract = self._empty_buffers(n)
        done = self.backend.read(self.request(seq, start, n, **buffers, **kw))
        return done, extract()

    # -- payloads and buffers --------------------------------------------------------------

    def payload(self, seq: Sequence_, start: int, n: int, version: int = 0) -> list[list[bytes]]:
        return [
            [
                payload_for(seq.keys[i], p, self.layout.part_bytes(p), version).tobytes()
                for p in self.parts
            ]
            for i in range(start, start + n)
        ]

    def _buffers_holding(self, payload: list[list[bytes]]) -> dict[str, object]:
        buffers, _ = self._empty_buffers(len(payload), payload)
        return buffers

    def _empty_buffers(self, n: int, fill: list[list[bytes]] | None = None):
        if self.io == "host":
            return self._host_buffers(n, fill)
        return self._device_buffers(n, fill)

    def _host_buffers(self, n: int, fill: list[list[bytes]] | None):
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

    def _device_buffers(self, n: int, fill: list[list[bytes]] | None):
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


def blocks_equal(got: Sequence[Sequence[bytes]], want: Sequence[Sequence[bytes]]) -> list[int]:
    """Indices of blocks whose parts differ (empty when all equal)."""
    return [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if list(g) != list(w)]
