"""Request traces in the Mooncake JSONL format (the FAST'25 release of Kimi / Moonshot AI).

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``: one id per block of the prompt, ``tokens_per_block`` tokens each
(512 in the published traces), equal ids meaning the same prefix block. Requests are replayed
in file order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Trace", "TraceError", "TraceRequest", "load_trace"]

#: tokens per block in the published Mooncake traces
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

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


def _int_field(obj: dict, name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name!r} must be an integer >= 0, got {value!r}")
    return value


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a request must be a JSON object, got {type(obj).__name__}")
    stamp = obj.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise TraceError(f"{where}: 'timestamp' must be a number, got {stamp!r}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {ids!r}")
    for k, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise TraceError(f"{where}: hash_ids[{k}] must be an integer >= 0, got {b!r}")
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
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse(line, f"{path}, line {number}"))
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(tuple(requests), tokens_per_block, str(path))
