"""Prefix keys: chained SHA-256 block hashes and the object names stored per block.

A block's key commits to every token before it, so equal keys mean equal prefixes and a
prefix cache can look blocks up one by one. Keys depend only on the token ids and the scope
(never on Python's ``hash``), so every process and machine computes the same names.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np
from pydantic import Field

from kvcore.config import StrictModel

__all__ = [
    "THIS_PROCESS_ONLY",
    "BlockId",
    "KeyScope",
    "NameRows",
    "ObjectName",
    "ScopedKeys",
    "block_hashes",
    "identities",
    "name_columns",
    "names_in_scope",
    "object_name",
    "object_names",
    "parse_object_name",
    "root_hash",
]

KEY_FORMAT = b"kvcore.block.v1"
_TOKEN_MAX = 2**32  # token ids are hashed as little-endian uint32


class KeyScope(StrictModel):
    """Everything besides the tokens that makes a cached block valid.

    Two engines share blocks only when all of these match: a different model, adapter or
    weight version must never read another's KV.
    """

    model: str = ""
    namespace: str = "default"
    adapter: str = ""
    weight_version: str = ""
    extra: dict[str, str] = Field(default_factory=dict)


def root_hash(scope: KeyScope | None = None) -> bytes:
    """Hash that seeds every chain: the format tag and the canonical JSON of the scope."""
    scope = scope or KeyScope()
    canonical = json.dumps(scope.model_dump(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(KEY_FORMAT + b"\0" + canonical.encode()).digest()


def _token_bytes(token_ids: Sequence[int] | np.ndarray, n_tokens: int) -> bytes:
    arr = np.asarray(token_ids[:n_tokens] if n_tokens else [], dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= _TOKEN_MAX):
        bad = int(arr[(arr < 0) | (arr >= _TOKEN_MAX)][0])
        raise ValueError(f"token_ids contains {bad}, outside [0, 2**32)")
    return arr.astype("<u4").tobytes()


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    scope: KeyScope | None = None,
    *,
    parent: str | None = None,
) -> list[str]:
    """Hex keys of every full block of ``token_ids``; a trailing partial block gets none.

    ``parent`` continues a chain: pass the key of the block before ``token_ids[0]``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    data = _token_bytes(token_ids, n_full * block_size)
    digest = bytes.fromhex(parent) if parent else root_hash(scope)
    stride = block_size * 4
    keys = []
    for i in range(n_full):
        digest = hashlib.sha256(digest + data[i * stride : (i + 1) * stride]).digest()
        keys.append(digest.hex())
    return keys


#: A scope value no other process has: what an adapter puts in its scope where it cannot know
#: part of the identity (a setting its engine does not show it), so its blocks are shared with
#: no other process rather than with one whose KV may differ.
#:
#: .. versionadded:: 0.3
THIS_PROCESS_ONLY = f"unknown, process {os.getpid()} {os.urandom(8).hex()}"


class ScopedKeys:
    """Block keys for an engine that names its blocks itself, by chained digests that already
    commit to everything that makes a block's KV what it is (vLLM's block hashes: the tokens,
    LoRA adapter, multimodal items, prompt embeddings and ``cache_salt``, each tagged by kind).

    A key is the scope's digest (the first 128 bits of :func:`root_hash`, hex) followed by the
    engine's digest in hex. So two scopes never share a key, one scope maps an engine digest to
    the same key in every process, and a key, or an object name built from it, gives the
    engine's digest back (:meth:`digest`) with no table to keep: an event about an object
    another process stored names the engine's block.

    Only digests the engine computes the same way in every process may be keyed this way
    (vLLM: a cryptographic ``prefix_caching_hash_algo``, or a shared ``PYTHONHASHSEED``).

    .. versionadded:: 0.3
    """

    __slots__ = ("prefix",)

    def __init__(self, scope: KeyScope) -> None:
        self.prefix = root_hash(scope).hex()[:32]

    def key(self, digest: bytes) -> str:
        """The key of the block the engine names ``digest``."""
        return self.prefix + digest.hex()

    def keys(self, digests: Sequence[bytes]) -> list[str]:
        prefix = self.prefix
        return [prefix + d.hex() for d in digests]

    def digest(self, key: str) -> bytes | None:
        """The engine's digest of ``key``; None for a key of another scope (or not of this
        form)."""
        if not key.startswith(self.prefix) or len(key) == len(self.prefix):
            return None
        try:
            return bytes.fromhex(key[len(self.prefix) :])
        except ValueError:
            return None


def object_name(
    block_key: str,
    part: str,
    *,
    namespace: str,
    rank: int,
    world_size: int,
    weight_version: str = "",
) -> str:
    """Name of one stored object: one block's ``part`` (k, v, k_scale, v_scale) on one rank.

    Rank and world size are in the name because each tensor-parallel rank holds a different
    slice of the heads; a cache written with another TP degree must not be read back. A weight
    version, when set, ends the name: KV of other weights is then another object.
    """
    return object_names(
        [block_key],
        [part],
        namespace=namespace,
        rank=rank,
        world_size=world_size,
        weight_version=weight_version,
    )[0][0]


class NameRows(Sequence[tuple[str, ...]]):
    """``[block][part]`` object names, held as one list per part and read as rows.

    Rows (``rows[i][j]``) are what the hook contract promises; the per-part lists
    (:meth:`column`) are what batch clients take and what is cheap to build: a 10,000-block
    request's names cost one ``join`` and one ``split`` per part, and no tuple per block
    until a backend asks for one. Slices share nothing mutable and stay lazy.
    """

    __slots__ = ("_columns", "_keys", "_n", "_origin")

    def __init__(self, columns: Sequence[list[str]], n: int) -> None:
        self._columns = tuple(columns)
        self._n = n
        # set by object_names: the names' identity, so it is never read back from the text
        self._origin: _Origin | None = None
        self._keys: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> tuple[str, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> NameRows: ...
    def __getitem__(self, index: int | slice) -> tuple[str, ...] | NameRows:
        if isinstance(index, slice):
            lo, hi, step = index.indices(self._n)
            cols = [c[lo:hi:step] for c in self._columns]
            rows = NameRows(cols, len(range(lo, hi, step)))
            if self._keys is not None:
                rows._origin, rows._keys = self._origin, self._keys[lo:hi:step]
            return rows
        if not self._columns:
            if not -self._n <= index < self._n:
                raise IndexError(index)
            return ()
        return tuple(c[index] for c in self._columns)

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        if not self._columns:
            return iter([()] * self._n)
        return zip(*self._columns, strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(
                a == tuple(b) for a, b in zip(self, other, strict=False)
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"NameRows({list(self)!r})"

    def column(self, part: int) -> list[str]:
        """Every block's name of part ``part`` (index into the request's ``parts``)."""
        return self._columns[part]

    def take(self, indices: Sequence[int]) -> NameRows:
        """The rows at block ``indices`` (in that order; negative ones count from the end),
        keeping the names' identity: what a caller that keeps some blocks of a request (the
        ones not cancelled, the ones to undo) builds instead of plain rows, so the identity
        is never read back from the text below it. Lazy, like a slice: no row tuples.

        :raises IndexError: an index outside the rows.

        .. versionadded:: 0.3
        """
        n = self._n
        picked = [operator.index(i) for i in indices]
        for i in picked:
            if not -n <= i < n:
                raise IndexError(f"block index {i} out of range for {n} rows")
        rows = NameRows([[c[i] for i in picked] for c in self._columns], len(picked))
        if self._keys is not None:
            keys = self._keys
            rows._origin, rows._keys = self._origin, tuple(keys[i] for i in picked)
        return rows

    @property
    def typed(self) -> bool:
        """Whether these names carry their identity (:func:`object_names` built them)."""
        return self._keys is not None

    def identity(self, block: int, part: int) -> ObjectName | None:
        """The identity of ``self[block][part]``, without reading the name; None for names
        built otherwise (see :meth:`ObjectName.parse`).

        .. versionadded:: 0.3
        """
        origin, keys = self._origin, self._keys
        if origin is None or keys is None:
            return None
        return ObjectName(
            origin.namespace,
            keys[block],
            origin.parts[part],
            origin.rank,
            origin.world_size,
            origin.weight_version,
        )

    def blocks(self) -> list[BlockId] | None:
        """Each row's block (what :attr:`ObjectName.block` gives for any of its names),
        without reading the names; None for names built otherwise.

        .. versionadded:: 0.3
        """
        origin, keys = self._origin, self._keys
        if origin is None or keys is None:
            return None
        namespace, rank, world, version = (
            origin.namespace, origin.rank, origin.world_size, origin.weight_version
        )  # fmt: skip
        return [BlockId(namespace, key, rank, world, version) for key in keys]

    def with_parts(self, parts: Sequence[str]) -> NameRows | None:
        """The same blocks' names of other ``parts`` (e.g. their digests); None for names
        that do not carry their identity.

        .. versionadded:: 0.3
        """
        origin, keys = self._origin, self._keys
        if origin is None or keys is None:
            return None
        return object_names(
            keys,
            parts,
            namespace=origin.namespace,
            rank=origin.rank,
            world_size=origin.world_size,
            weight_version=origin.weight_version,
        )


def identities(names: Sequence[Sequence[str]], first: int | None = None) -> list[ObjectName | None]:
    """The identity of every object of the first ``first`` rows of ``names`` (all: None), row
    by row: carried by :class:`NameRows` that kvcore built, read from the text otherwise.

    .. versionadded:: 0.3
    """
    rows = names if first is None else names[:first]
    if isinstance(rows, NameRows) and rows.typed:
        width = len(rows._columns)
        return [rows.identity(i, j) for i in range(len(rows)) for j in range(width)]
    return [ObjectName.parse(name) for row in rows for name in row]


def name_columns(names: Sequence[Sequence[str]], num_parts: int) -> list[list[str]]:
    """A request's object names as one sequence per part (``names[i][j]`` for every block
    ``i``, for each part ``j``). Free for names kvcore built (:class:`NameRows`); one pass over
    plain rows, which a ``BlockRequest`` built by other code may carry.

    .. versionadded:: 0.2
    """
    if isinstance(names, NameRows):
        return [names.column(j) for j in range(num_parts)]
    return [[row[j] for row in names] for j in range(num_parts)]


def object_names(
    block_keys: Sequence[str],
    parts: Sequence[str],
    *,
    namespace: str,
    rank: int,
    world_size: int,
    weight_version: str = "",
) -> NameRows:
    """``[block][part]`` object names for a run of blocks (same names as :func:`object_name`).

    .. versionchanged:: 0.2 a :class:`NameRows` (a sequence of row tuples, built lazily).
    """
    names = names_in_scope(
        block_keys, parts, namespace=namespace, scope=_scope(rank, world_size, weight_version)
    )
    names._origin = _Origin(namespace, tuple(parts), rank, world_size, weight_version)
    names._keys = tuple(block_keys)
    return names


def _scope(rank: int, world_size: int, weight_version: str) -> str:
    return f"/r{rank}of{world_size}" + (f"/w{weight_version}" if weight_version else "")


class _Origin(NamedTuple):
    """What a run of names kvcore built shares: every field of their identity but the key."""

    namespace: str
    parts: tuple[str, ...]
    rank: int
    world_size: int
    weight_version: str


def names_in_scope(
    block_keys: Sequence[str], parts: Sequence[str], *, namespace: str, scope: str
) -> NameRows:
    """Object names ``{namespace}/{key}/{part}{scope}``: :func:`object_names` with the scope
    (rank, world size, weight version) already formatted, e.g. taken from names built before."""
    keys = list(block_keys)
    columns = []
    for part in parts:
        tail = f"/{part}{scope}"
        # one join and one split per part; a newline anywhere (keys are data) changes the
        # count, and then the names are built one by one
        joiner = tail + "\n" + namespace + "/"
        names = (namespace + "/" + joiner.join(keys) + tail).split("\n")
        if len(names) != len(keys):
            names = [f"{namespace}/{k}{tail}" for k in keys]
        columns.append(names)
    return NameRows(columns, len(keys))


class BlockId(NamedTuple):
    """One block of one rank, as its objects' names say: every part of it shares this.

    .. versionadded:: 0.3
    """

    namespace: str
    block_key: str
    rank: int
    world_size: int
    weight_version: str


class ObjectName(NamedTuple):
    """The identity of one object kvcore names (:func:`object_names`): the one type an object
    name has from the request that builds it to the event that reports it.

    A request's :class:`NameRows` give each name's identity (:meth:`NameRows.identity`) and
    events carry them (:attr:`kvcore.events.StoreEvent.objects`), so nothing re-reads fields
    from a string. :meth:`parse` is the one way back from a string, for names that arrive as
    text: a backend's own reports, a store's journal, the hook contract's plain rows.

    .. versionadded:: 0.3
    .. versionchanged:: 0.3 :meth:`parse`, :meth:`format`, :attr:`block`, :meth:`with_part`.
    """

    namespace: str
    block_key: str
    part: str
    rank: int
    world_size: int
    weight_version: str

    @classmethod
    def parse(cls, name: str) -> ObjectName | None:
        """The identity of ``name`` if kvcore built it, else None (an adapter may store
        objects under an engine's own names, FastDeploy's say: those are opaque)."""
        m = _NAME_RE.match(name)
        if m is None:
            return None
        return cls(
            m["namespace"],
            m["key"],
            m["part"],
            int(m["rank"]),
            int(m["world"]),
            m["version"] or "",
        )

    def format(self) -> str:
        """The object's name (what :func:`object_names` builds)."""
        return f"{self.namespace}/{self.block_key}/{self.part}{self.scope}"

    @property
    def scope(self) -> str:
        """The name's tail after the part: rank, world size and weight version."""
        return _scope(self.rank, self.world_size, self.weight_version)

    @property
    def block(self) -> BlockId:
        """The block (of its rank) this object is a part of."""
        return BlockId(
            self.namespace, self.block_key, self.rank, self.world_size, self.weight_version
        )

    def with_part(self, part: str) -> ObjectName:
        """The identity of the same block's object ``part``."""
        return self._replace(part=part)


# {namespace}/{key}/{part}/r{rank}of{world}[/w{version}]; the namespace may hold slashes
# (the key and the fields after it never do)
_NAME_RE = re.compile(
    r"^(?P<namespace>.*)/(?P<key>[^/]+)/(?P<part>[^/]+)/r(?P<rank>\d+)of(?P<world>\d+)"
    r"(?:/w(?P<version>[A-Za-z0-9._-]{0,64}))?$"
)


def parse_object_name(name: str) -> ObjectName | None:
    """The fields of ``name`` if kvcore built it, else None.

    .. versionadded:: 0.3
    .. deprecated:: 0.3 use :meth:`ObjectName.parse` (kept until 0.4).
    """
    return ObjectName.parse(name)
