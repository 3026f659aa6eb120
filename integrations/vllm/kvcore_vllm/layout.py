"""vLLM's KV cache, described to kvcore.

Two questions, answered from vLLM's own objects rather than assumed:

- :func:`cache_layout`: what one block of one rank is (layers, heads, tokens, head size, dtype),
  from the scheduler's ``KVCacheConfig``. Both the scheduler and every worker compute it, so
  both open the backend with the same layout.
- :func:`map_layer_tensors`: where each layer's blocks are in the tensors vLLM hands to
  ``register_kv_caches``. The block dimension is found from shapes and strides. Two physical
  forms occur:

  * **K and V apart** (``[2, num_blocks, ...]``, e.g. FlashAttention's): the K and V halves of a
    layer are two tensors whose first dimension is the blocks, exactly what kvcore's
    ``DeviceCache`` takes. kvcore's ``k`` object of a block holds the K bytes of every layer.
  * **K and V together in each block** (``[num_blocks, heads, block_size, 2 * head_size]``, the CPU
    backend's: per head, the block's K rows then its V rows): one block of one layer is one
    contiguous run of ``2 * kv_layer_block_bytes`` bytes, but its K bytes are not contiguous, so
    no per-layer K tensor exists. kvcore moves whole blocks and never looks inside them, so a
    block is split in two halves of equal size that play the ``k`` and ``v`` parts:

    - with an even number of layers, halves of the *layer list*: the ``k`` object of a block is
      its whole run in each of the first half of the layers, the ``v`` object the same in the
      second half. The cache is described to kvcore as half the layers, each twice as wide
      (:attr:`LayerMapping.layout`, which stores the same objects as the scheduler's layout:
      ``CacheLayout.stores_like``), the per-layer tensors are the layers themselves, and
      kvcore's block ids are vLLM's. An object is then ``layers / 2`` pieces of a whole layer
      block rather than ``layers`` pieces of half of one: Mooncake's transport costs about
      20 µs per piece, so a restore moves half as many pieces (measured on loopback, 98.6 MB:
      3008 pieces of 32 KiB in 59 ms, 1504 of 64 KiB in 42 ms);
    - with an odd number, halves of each layer's run: viewing the layer as rows of half a
      block, block ``b``'s first half is row ``2b`` of a view that starts at the layer's first
      byte and its second half is row ``2b`` of a view that starts half a block later (both
      contiguous ``[rows, half]`` views over vLLM's memory), and kvcore is given device block
      ``2b`` for vLLM block ``b``.

    Either way the stored objects hold pieces of whole blocks rather than pure K and V; the
    key scope names the object format, so engines whose blocks are laid out differently never
    share objects.

**MLA** (DeepSeek, Kimi): a token's cache is one latent vector (``kv_lora_rank`` plus the
rotary part, e.g. 512 + 64 elements), the same on every TP rank, and a layer's block is one
dense run of ``block_size`` latents. It is stored in the K-and-V-together form above: each
latent described as two halves (``num_heads`` 1, ``head_dim`` half the latent), so the ``k``
and ``v`` objects of a block are the halves of its runs, never K and V. The key scope names the
spec (``kv_spec: mla``), so an MLA block never restores into a model with separate K and V.
Being replicated, it is stored once per block, not once per rank (:func:`replicated_across_tp`;
:class:`kvcore_vllm.context.StoredRanks`).

**Mamba state** (Qwen3-Next's gated delta net, Granite 4 and Nemotron-H's Mamba-2, ...): with
prefix caching on, vLLM keeps the recurrent state reached at a block boundary in that block
(``mamba_cache_mode`` ``align``): block ``i`` of a Mamba group holds the state after token
``(i + 1) * block_size - 1``, one page per layer that holds every state tensor (conv, SSM)
and the padding vLLM adds to match the attention pages. A page is moved whole, as bytes
(:func:`map_state_tensors`): it is described to kvcore as ``uint8`` blocks of half a page per
half. The key scope names the state's shapes and dtypes (:attr:`CacheGroup.state`).

Anything else (padded attention pages, quantised caches with separate scales, float32 K/V,
which kvcore's layout cannot name) is refused with an error that says what was found.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import kvcore

if TYPE_CHECKING:
    import torch

__all__ = [
    "CacheGroup",
    "LayerMapping",
    "UnsupportedCacheError",
    "cache_groups",
    "cache_layout",
    "kv_dtype_name",
    "map_layer_tensors",
    "map_state_tensors",
    "replicated_across_tp",
]


class UnsupportedCacheError(ValueError):
    """vLLM's cache for this model cannot be stored by the connector (the message says why)."""


def kv_dtype_name(dtype: Any) -> str:
    """kvcore's name for a torch dtype of the KV cache."""
    import torch

    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "uint8"}
    for fp8 in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, fp8):
            names[getattr(torch, fp8)] = "uint8"  # one-byte elements, moved as bytes
    if dtype not in names:
        raise UnsupportedCacheError(
            f"KV cache dtype {dtype} has no kvcore CacheDType (bfloat16, float16, one-byte fp8); "
            "serve the model in bfloat16 or float16 (--dtype) to use KVCoreConnector"
        )
    return names[dtype]


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group of vLLM's ``KVCacheConfig`` the connector stores.

    ``kind`` is ``full`` (full attention), ``sliding_window``, ``mla`` or ``mamba``; ``window``
    the tokens a restore needs before its position: the sliding window (its retained tokens
    added), one block for Mamba (the state at the boundary), None for the others. ``state``
    describes a Mamba group's state (shapes, dtypes, kind) for its key scope.
    """

    index: int
    kind: str
    layer_names: tuple[str, ...]
    spec: Any
    window: int | None = None
    state: str | None = None

    @property
    def is_state(self) -> bool:
        """A recurrent state: a restore needs exactly the block ending at its position."""
        return self.kind == "mamba"

    def first_needed_block(self, computed_blocks: int, block_size: int) -> int:
        """The first block a restore of ``computed_blocks`` blocks needs in this group: 0 for
        full attention, the first block inside the window of the next token for a sliding
        window (the blocks before it are never read again, as vLLM's own manager frees them)."""
        if self.window is None:
            return 0
        skipped = max(0, computed_blocks * block_size - self.window + 1)
        return min(skipped // block_size, computed_blocks)


def cache_groups(kv_cache_config: Any) -> list[CacheGroup]:
    """The groups the connector stores, full attention first; one line naming the group and
    why for anything it cannot store (cross-attention, an MLA hybrid, Mamba state that vLLM
    does not keep per block, ...)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    found: list[CacheGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        where = f"KV cache group {index} ({type(spec).__name__}, {len(group.layer_names)} layers)"
        if isinstance(spec, MLAAttentionSpec):
            if len(groups) != 1:
                raise UnsupportedCacheError(
                    f"{where}: MLA in a hybrid model is not stored by KVCoreConnector"
                )
            found.append(CacheGroup(index, "mla", tuple(group.layer_names), _mla_spec(spec)))
        elif isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))
            found.append(
                CacheGroup(
                    index, "sliding_window", tuple(group.layer_names), _dense(spec, where), window
                )
            )
        elif isinstance(spec, FullAttentionSpec):
            found.append(CacheGroup(index, "full", tuple(group.layer_names), _dense(spec, where)))
        elif isinstance(spec, MambaSpec):
            found.append(
                CacheGroup(
                    index,
                    "mamba",
                    tuple(group.layer_names),
                    _mamba_spec(spec, where),
                    window=int(spec.block_size),
                    state=_state_text(spec),
                )
            )
        else:
            raise UnsupportedCacheError(
                f"{where}: KVCoreConnector stores full-attention, sliding-window, MLA and Mamba "
                "groups; this group's cache cannot be restored from blocks"
            )
    sizes = {g.spec.block_size for g in found}
    if len(sizes) != 1:
        raise UnsupportedCacheError(
            f"KV cache groups have block sizes {sorted(sizes)}; KVCoreConnector needs one"
        )
    if not any(g.window is None for g in found):
        raise UnsupportedCacheError(
            "every KV cache group is a sliding window or a Mamba state; KVCoreConnector keys "
            "restores by a full-attention (or MLA) group"
        )
    return sorted(found, key=lambda g: (g.window is not None, g.index))


def _single_attention_spec(kv_cache_config: Any) -> Any:
    """The spec of the first group the connector stores (for one-group models: the only one)."""
    return cache_groups(kv_cache_config)[0].spec


def _dense(spec: Any, where: str) -> Any:
    """A full-attention or sliding-window spec, after refusing pages kvcore cannot name."""
    odd = {
        "head_size_v": spec.head_size_v if spec.head_size_v != spec.head_size else None,
        "page_size_padded": getattr(spec, "page_size_padded", None),
        "num_head_slots": getattr(spec, "num_head_slots", None),
        "state_content_bytes": getattr(spec, "state_content_bytes", None),
        "tokens_per_state": None if getattr(spec, "tokens_per_state", 1) == 1 else spec,
    }
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        odd["kv_quant_mode"] = quant
    found = {k: v for k, v in odd.items() if v is not None}
    if found:
        raise UnsupportedCacheError(
            f"{where}: KV cache spec {type(spec).__name__} has {sorted(found)} set; "
            "KVCoreConnector stores dense K/V pages with equal K and V head sizes"
        )
    return spec


def _mla_spec(spec: Any) -> Any:
    """An MLA group's spec, after refusing the latent forms the halves cannot describe."""
    odd = {
        "num_kv_heads": spec.num_kv_heads if spec.num_kv_heads != 1 else None,
        "odd head_size": spec.head_size if spec.head_size % 2 else None,
        "page_size_padded": getattr(spec, "page_size_padded", None),
        "sliding_window": getattr(spec, "sliding_window", None),
        "index cache (sparse attention)": getattr(spec, "is_index_group_leader", None) or None,
    }
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        odd["kv_quant_mode"] = quant
    found = {k: v for k, v in odd.items() if v is not None}
    if found:
        raise UnsupportedCacheError(
            f"MLA KV cache spec has {sorted(found)}; KVCoreConnector stores one dense latent "
            "per token with an even number of elements"
        )
    return spec


def _mamba_spec(spec: Any, where: str) -> Any:
    """A Mamba group's spec, after refusing the states no block boundary holds."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedCacheError(
            f"{where}: mamba_cache_mode is {mode!r}, so vLLM keeps no state at block "
            "boundaries to store; turn prefix caching on (mamba_cache_mode 'align')"
        )
    odd = {
        "num_speculative_blocks": getattr(spec, "num_speculative_blocks", 0) or None,
        "tp_replicated": getattr(spec, "tp_replicated", False) or None,
    }
    found = {k: v for k, v in odd.items() if v is not None}
    if found:
        raise UnsupportedCacheError(
            f"{where}: Mamba spec has {sorted(found)}; KVCoreConnector stores one state per "
            "block boundary, sharded like the attention heads, without speculative blocks"
        )
    if spec.page_size_bytes % (2 * spec.block_size):
        raise UnsupportedCacheError(
            f"{where}: a state page of {spec.page_size_bytes} bytes is not two halves of "
            f"{spec.block_size} rows"
        )
    return spec


def _state_text(spec: Any) -> str:
    """What a Mamba state is, for its key scope: two models share a state only when all of it
    is the same (a float32 SSM state never restores into a bfloat16 one)."""
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    shapes = ";".join(
        f"{'x'.join(str(n) for n in shape)}:{str(dtype).removeprefix('torch.')}"
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
    return f"{kind}[{shapes}]page{spec.page_size_bytes}"


def replicated_across_tp(kv_cache_config: Any) -> bool:
    """Whether every TP rank holds the same cache (MLA's latent): stored once, read by all."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(_single_attention_spec(kv_cache_config), MLAAttentionSpec)


def cache_layout(
    kv_cache_config: Any, per_head: bool = False, group: CacheGroup | None = None
) -> kvcore.CacheLayout:
    """One rank's cache of ``group`` (default: the first stored group) as kvcore describes it
    (block count left 0: the workers know it); ``per_head``: one KV head's share of a block
    (the TP-independent layout)."""
    group = group or cache_groups(kv_cache_config)[0]
    spec = group.spec
    num_layers = len(group.layer_names)
    if group.is_state:  # a page of bytes, as two halves (docstring)
        if per_head:
            raise UnsupportedCacheError(
                f"KV cache group {group.index} (Mamba state): object_layout per_head stores "
                "attention heads; a state is stored per rank (object_layout per_rank)"
            )
        return kvcore.CacheLayout(
            num_layers=num_layers,
            num_heads=1,
            block_size=spec.block_size,
            head_dim=spec.page_size_bytes // (2 * spec.block_size),
            dtype="uint8",
        )
    if group.kind == "mla":  # a latent as two halves (docstring)
        return kvcore.CacheLayout(
            num_layers=num_layers,
            num_heads=1,
            block_size=spec.block_size,
            head_dim=spec.head_size // 2,
            dtype=kv_dtype_name(spec.dtype),
        )
    return kvcore.CacheLayout(
        num_layers=num_layers,
        num_heads=1 if per_head else spec.num_kv_heads,
        block_size=spec.block_size,
        head_dim=spec.head_size,
        dtype=kv_dtype_name(spec.dtype),
    )


@dataclass(frozen=True)
class LayerMapping:
    """Per-layer K and V tensors for kvcore's ``DeviceCache``, and how block ids translate.

    ``kvcore_block = vllm_block * id_scale`` (2 for the K-and-V-together form split inside
    each layer, else 1). ``kv_format`` names the physical form. ``layout`` is how the tensors
    describe the cache to kvcore's ``DeviceCache`` and ``TransferManager``; it stores the same
    objects as the scheduler's layout.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    id_scale: int
    kv_format: str
    layout: kvcore.CacheLayout
    #: KV heads kept apart in each block (the per-head layout), else 1
    pieces: int = 1

    def to_kvcore(self, vllm_block_ids: list[int], piece: int = 0) -> list[int]:
        """kvcore's block ids of ``vllm_block_ids`` (their head ``piece``, per head)."""
        scale, pieces = self.id_scale, self.pieces
        if scale == 1 and pieces == 1:
            return list(vllm_block_ids)
        return [(b * pieces + piece) * scale for b in vllm_block_ids]


#: The two physical forms (see the module docstring).
FORM_SPLIT = "kv-split"
FORM_JOINED = "kv-joined"


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, strides {list(t.stride())}, dtype {t.dtype}"


def _map_one(
    name: str, t: torch.Tensor, num_blocks: int, half_bytes: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(k, v, form) for one layer's tensor; raise naming the layer when neither form fits."""
    item = t.element_size()
    half = half_bytes // item  # elements in half a block of this layer
    shape, stride = tuple(t.shape), tuple(t.stride())
    # K and V apart: the leading dimension of size 2 selects K or V, the next one is blocks.
    if (
        len(shape) >= 3
        and shape[0] == 2
        and shape[1] == num_blocks
        and stride[1] == half
        and stride[0] == num_blocks * half
        and t[0].is_contiguous()
        and t[1].is_contiguous()
    ):
        return t[0], t[1], FORM_SPLIT
    # K and V together: some dimension is the blocks, a block is one dense run of 2 halves.
    block_dims = [d for d, n in enumerate(shape) if n == num_blocks and stride[d] == 2 * half]
    if (
        block_dims
        and t.is_contiguous()
        and block_dims[0] == 0
        and t.numel() == num_blocks * 2 * half
    ):
        flat = t.view(-1)
        rows = 2 * num_blocks - 1  # row 2b of either view is a half of block b; see docstring
        k = flat[: rows * half].view(rows, half)
        v = flat[half : half + rows * half].view(rows, half)
        return k, v, FORM_JOINED
    raise UnsupportedCacheError(
        f"layer {name!r}: cannot find {num_blocks} blocks of {2 * half_bytes} bytes (K and V "
        f"of {half_bytes} bytes each) in its KV tensor ({_describe(t)}); KVCoreConnector "
        "supports [2, num_blocks, ...] tensors with contiguous K and V, and contiguous "
        "[num_blocks, ...] tensors whose blocks hold K and V together"
    )


def _head_rows(name: str, t: torch.Tensor, num_blocks: int, heads: int, block_size: int) -> Any:
    """``t`` with each KV head of each block as one row (block-major), for the per-head
    layout: possible where a block holds its heads one after another (the CPU backend's
    ``[blocks, heads, block_size, ...]``, or K and V apart in the HND order ``[2, blocks, heads,
    block_size, head_size]``); else an error naming the layer."""
    shape = tuple(t.shape)
    if heads != block_size and t.is_contiguous():
        if len(shape) >= 3 and shape[:3] == (num_blocks, heads, block_size):
            return t.view(num_blocks * heads, -1)
        if len(shape) >= 4 and shape[:4] == (2, num_blocks, heads, block_size):
            return t.view(2, num_blocks * heads, -1)
    raise UnsupportedCacheError(
        f"layer {name!r}: object_layout per_head needs each block's {heads} KV heads one after "
        f"another ([blocks, heads, block_size, ...] or [2, blocks, heads, block_size, ...]); its "
        f"KV tensor has {_describe(t)} (use object_layout per_rank, or an HND KV cache layout)"
    )


def map_layer_tensors(
    kv_caches: dict[str, torch.Tensor],
    layer_names: list[str],
    layout: kvcore.CacheLayout,
    num_blocks: int,
    pieces: int = 0,
) -> LayerMapping:
    """Map ``register_kv_caches``' tensors (in the KV cache group's layer order) for kvcore.

    ``pieces`` (the per-head layout, ``layout`` then one head's share): the KV heads of each
    block on this rank, each a kvcore block of its own (:meth:`LayerMapping.to_kvcore`).
    """
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise UnsupportedCacheError(
            f"register_kv_caches got no tensor for layers {missing[:3]} of the KV cache group"
        )
    if pieces:
        kv_caches = {
            name: _head_rows(name, kv_caches[name], num_blocks, pieces, layout.block_size)
            for name in layer_names
        }
        mapping = map_layer_tensors(kv_caches, layer_names, layout, num_blocks * pieces)
        return replace(mapping, pieces=pieces)
    half_bytes = layout.kv_layer_block_bytes
    k: list[Any] = []
    v: list[Any] = []
    forms = set()
    for name in layer_names:
        t = kv_caches[name]
        if t.element_size() != layout.dtype.itemsize:
            raise UnsupportedCacheError(
                f"layer {name!r} has {t.element_size()}-byte elements; the KV cache spec says "
                f"{layout.dtype.value} ({layout.dtype.itemsize} bytes)"
            )
        k_t, v_t, form = _map_one(name, t, num_blocks, half_bytes)
        k.append(k_t)
        v.append(v_t)
        forms.add(form)
    if len(forms) != 1:
        raise UnsupportedCacheError(f"layers mix physical KV forms {sorted(forms)}")
    form = forms.pop()
    if form == FORM_JOINED and len(layer_names) % 2 == 0:
        # halves of the layer list: each layer's whole blocks, half the pieces per object
        whole = [kv_caches[name].view(num_blocks, -1) for name in layer_names]
        half_list = len(whole) // 2
        paired = kvcore.CacheLayout(
            **{
                **layout.model_dump(),
                "num_layers": layout.num_layers // 2,
                "head_dim": 2 * layout.head_dim,
            }
        )
        return LayerMapping(
            k=whole[:half_list], v=whole[half_list:], id_scale=1, kv_format=form, layout=paired
        )
    scale = 2 if form == FORM_JOINED else 1
    return LayerMapping(k=k, v=v, id_scale=scale, kv_format=form, layout=layout)


def map_state_tensors(
    kv_caches: dict[str, Any],
    layer_names: list[str],
    layout: kvcore.CacheLayout,
    num_blocks: int,
) -> LayerMapping:
    """Map a Mamba group's layers for kvcore: each layer's state tensors (conv, SSM, ...) are
    views into one page per block; the pages, as ``uint8`` rows, are what is stored."""
    page = 2 * layout.kv_layer_block_bytes
    pages: dict[str, Any] = {}
    for name in layer_names:
        states = kv_caches.get(name)
        if states is None:
            raise UnsupportedCacheError(
                f"register_kv_caches got no tensor for layer {name!r} of the Mamba group"
            )
        pages[name] = _state_pages(name, states, num_blocks, page)
    return map_layer_tensors(pages, layer_names, layout, num_blocks)


def _state_pages(name: str, states: Any, num_blocks: int, page: int) -> Any:
    """One layer's pages as a ``[num_blocks, page]`` uint8 view over vLLM's memory, after
    checking that every state tensor lies inside its block's page."""
    import torch

    tensors = list(states) if isinstance(states, (list, tuple)) else [states]
    base = min(t.data_ptr() for t in tensors)
    storage = tensors[0].untyped_storage()
    start = base - storage.data_ptr()
    for t in tensors:
        inside = (
            t.untyped_storage().data_ptr() == storage.data_ptr()
            and t.shape[0] == num_blocks
            and t.stride(0) * t.element_size() == page
            and t[0].is_contiguous()
            and t.data_ptr() - base + t[0].numel() * t.element_size() <= page
        )
        if not inside:
            raise UnsupportedCacheError(
                f"layer {name!r}: a state tensor ({_describe(t)}) is not {num_blocks} pages of "
                f"{page} bytes of one allocation"
            )
    if start < 0 or start + num_blocks * page > storage.nbytes():
        raise UnsupportedCacheError(
            f"layer {name!r}: {num_blocks} pages of {page} bytes overrun the state's memory"
        )
    view = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    return view.set_(storage, start, (num_blocks, page), (page, 1))
