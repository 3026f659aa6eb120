"""Request traces in the Mooncake JSONL format (the FAST'25 release of Kimi / Moonshot AI).

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``: one id per block of the prompt, ``tokens_per_block`` tokens each
(512 in the published traces), equal ids meaning the same prefix block. Requests are replayed
in file order.

A trace is input from anywhere, so reading it is bounded: only a regular file is read (a FIFO,
a device such as ``/dev/zero`` or a directory is refused before anything is read, so nothing
hangs), a line is at most :data:`MAX_LINE_BYTES`, a request at most :data:`MAX_REQUEST_BLOCKS`
hash ids (what an I/O replay allocates a cache for), a trace at most :data:`MAX_TRACE_BLOCKS`
ids in all, a number at most 19 digits and a hash id below 2**63. Whatever breaks a rule is a
:class:`TraceError` naming the file, the line and the field. The published conversation trace
(12,031 requests, 288,500 ids, longest request 247 ids, longest line 2 KiB) is far inside them.
"""

from __future__ import annotations

import heapq
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_REQUEST_BLOCKS",
    "MAX_TRACE_BLOCKS",
    "Trace",
    "TraceError",
    "TraceRequest",
    "flood_trace",
    "load_trace",
    "merge_traces",
]

#: tokens per block in the published Mooncake traces
MOONCAKE_BLOCK_TOKENS = 512
#: the longest line read (500 times the published trace's longest)
MAX_LINE_BYTES = 1 << 20
#: hash ids of one request: 8 M tokens at 512 per block (66 times the published trace's
#: longest request); an I/O replay's cache holds the longest request, 256 MiB at 16 KiB blocks
MAX_REQUEST_BLOCKS = 16_384
#: hash ids of a whole trace (58 times the published trace): about 1 GiB of requests in memory
MAX_TRACE_BLOCKS = 1 << 24
#: numbers of more digits are refused before Python converts them (hash ids are below 2**63)
_MAX_DIGITS = 19


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    #: whose request it is (:func:`merge_traces`); None: a trace without tenants
    tenant: str | None = None

    def block_tokens(self, i: int, tokens_per_block: int) -> int:
        """Prompt tokens in block ``i`` (the last block may be partly filled)."""
        return max(0, min(tokens_per_block, self.input_length - i * tokens_per_block))


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    tokens_per_block: int = MOONCAKE_BLOCK_TOKENS
    source: str = ""

    @property
    def block_refs(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def distinct_blocks(self) -> int:
        return len({b for r in self.requests for b in r.hash_ids})

    @property
    def longest_request_blocks(self) -> int:
        return max((len(r.hash_ids) for r in self.requests), default=0)

    def __len__(self) -> int:
        return len(self.requests)


def _int_field(obj: dict[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name!r} must be an integer >= 0, got {value!r}")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise _TooLong(f"a number of {len(text)} digits")
    return int(text)


class _TooLong(ValueError):
    pass


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    except _TooLong as exc:
        raise TraceError(f"{where}: {exc} (at most {_MAX_DIGITS})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    stamp = obj.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise TraceError(f"{where}: 'timestamp' must be a number, got {stamp!r}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r}"[:300])
    if len(ids) > MAX_REQUEST_BLOCKS:
        raise TraceError(
            f"{where}: 'hash_ids' holds {len(ids)} ids; a request may hold {MAX_REQUEST_BLOCKS}"
        )
    for k, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**63:
            raise TraceError(f"{where}: hash_ids[{k}] must be an integer in [0, 2**63), got {b!r}")
    return TraceRequest(
        float(stamp),
        _int_field(obj, "input_length", where),
        _int_field(obj, "output_length", where),
        tuple(ids),
    )


def load_trace(
    path: str | Path, *, limit: int | None = None, tokens_per_block: int = MOONCAKE_BLOCK_TOKENS
) -> Trace:
    """Read a Mooncake JSONL trace (blank lines skipped; ``limit``: the first requests only).

    :raises TraceError: a line that is not a request, naming the file, the line number and the
        field; a trace without requests.
    """
    if tokens_per_block < 1:
        raise TraceError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    path = Path(path)
    requests: list[TraceRequest] = []
    blocks = 0
    try:
        # O_NONBLOCK: opening a FIFO without a writer returns at once (and is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else (
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "something else"
        )  # fmt: skip
        raise TraceError(f"{path}: {kind}, not a regular file: a trace must be a file")
    with open(fd, "rb") as f:
        number = 0
        while limit is None or len(requests) < limit:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise TraceError(
                    f"cannot read trace {str(path)!r}: {exc.strerror or exc}"
                ) from None
            if not raw:
                break
            number += 1
            where = f"{path}, line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{where}: longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{where}: not UTF-8 text ({exc.reason})") from None
            if not line.strip():
                continue
            request = _parse(line, where)
            blocks += len(request.hash_ids)
            if blocks > MAX_TRACE_BLOCKS:
                raise TraceError(
                    f"{where}: the trace holds more than {MAX_TRACE_BLOCKS} hash ids in all"
                )
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(tuple(requests), tokens_per_block, str(path))


def merge_traces(traces: Mapping[str, Trace]) -> Trace:
    """One trace of several tenants' traces, merged by time: each request carries its
    tenant (the mapping's key), and requests of equal time keep their traces' order, the
    mapping's order between traces. Hash ids stay each trace's own: a replay keys a block by
    its tenant and its id, so equal ids of two tenants are two blocks.

    .. versionadded:: 0.3

    :raises TraceError: no traces, or traces of different ``tokens_per_block``.
    """
    if not traces:
        raise TraceError("merge_traces: no traces to merge")
    sizes = {t.tokens_per_block for t in traces.values()}
    if len(sizes) != 1:
        raise TraceError(
            f"merge_traces: the traces' tokens_per_block differ ({sorted(sizes)}): "
            "their blocks are not the same unit"
        )
    tagged = [[replace(r, tenant=name) for r in t.requests] for name, t in traces.items()]
    merged = heapq.merge(*tagged, key=lambda r: r.timestamp_ms)
    source = " + ".join(f"{name}: {t.source or 'trace'}" for name, t in traces.items())
    return Trace(tuple(merged), sizes.pop(), source)


def flood_trace(
    blocks: int,
    *,
    requests: int,
    span_ms: float,
    tokens_per_block: int = MOONCAKE_BLOCK_TOKENS,
    start_ms: float = 0.0,
) -> Trace:
    """A flood of ``blocks`` unique blocks in ``requests`` requests spread evenly over
    ``span_ms`` from ``start_ms``: a tenant that fills a store with blocks nobody reads again
    (a batch job prefilling unique prompts).

    .. versionadded:: 0.3
    """
    if blocks < 1 or requests < 1 or span_ms < 0:
        raise TraceError(
            f"flood_trace: blocks and requests must be >= 1 and span_ms >= 0, got "
            f"{blocks}, {requests}, {span_ms}"
        )
    out: list[TraceRequest] = []
    first = 0
    for n in range(requests):
        last = blocks * (n + 1) // requests
        ids = tuple(range(first, last))
        first = last
        if ids:
            at = start_ms + span_ms * n / max(1, requests - 1)
            out.append(TraceRequest(at, len(ids) * tokens_per_block, 1, ids))
    return Trace(tuple(out), tokens_per_block, f"flood of {blocks} unique blocks")
