"""An LMCache memory object's layout, stored with it as kvcore block metadata.

LMCache's keys carry no shape or dtype: fp16 and bf16 KV of one model have the same keys and
sizes. Each object is stored with its layout (byte size, LMCache memory format, shapes,
dtypes), which a load checks against its buffer (MP mode) or allocates from (in-process mode):
bytes are never read as another layout.

Importing this module imports neither LMCache nor torch: objects are duck-typed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Layout", "describe_layout", "layout_of", "parse_layout"]

_TAG = "lmcache1"


class Layout(NamedTuple):
    """A stored object's layout, as :func:`describe_layout` wrote it."""

    size: int
    fmt: str  # LMCache's MemoryFormat name
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # torch dtype names without "torch."


def describe_layout(size: int, fmt: Any, shapes: Any, dtypes: Any) -> bytes:
    """The block metadata of an object of ``size`` bytes: compact text, one field per space."""
    fmt_name = getattr(fmt, "name", str(fmt))
    shape_text = ";".join("x".join(str(int(d)) for d in shape) for shape in shapes)
    dtype_text = ";".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"{_TAG} {size} {fmt_name} {shape_text} {dtype_text}".encode()


def layout_of(obj: Any) -> bytes:
    """The block metadata of an LMCache ``MemoryObj``: objects of one group carry
    ``shapes``/``dtypes``; single-tensor objects only ``shape``/``dtype``."""
    meta = obj.metadata
    shapes = meta.shapes if meta.shapes is not None else [meta.shape]
    dtypes = meta.dtypes if meta.dtypes is not None else [meta.dtype]
    return describe_layout(obj.get_size(), meta.fmt, shapes, dtypes)


def parse_layout(meta: bytes | None) -> Layout | None:
    """The layout ``meta`` describes; None for anything :func:`describe_layout` did not write."""
    if meta is None:
        return None
    try:
        tag, size, fmt, shape_text, dtype_text = meta.decode().split(" ")
        if tag != _TAG:
            return None
        shapes = tuple(
            tuple(int(d) for d in shape.split("x")) if shape else ()
            for shape in shape_text.split(";")
        )
        dtypes = tuple(dtype_text.split(";"))
        if len(shapes) != len(dtypes):
            return None
        return Layout(int(size), fmt, shapes, dtypes)
    except ValueError:
        return None
