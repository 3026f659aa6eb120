"""Hook specifications: the contract between kvcore and a storage backend.

A backend is a class (or any callable) published under the entry-point group
``kvcore.backends``; the entry-point name is the backend's name. kvcore calls it as
``Backend(config, context)`` and registers the instance, alone, in a fresh
:class:`pluggy.PluginManager`, so every hook below reaches exactly one implementation and
``firstresult`` simply means "the backend's answer". The instance's class declares:

- ``config_model``: a subclass of :class:`kvcore.schemas.BackendConfig` (its own settings);
- ``capabilities``: a :class:`kvcore.schemas.Capabilities` (addressing and I/O kind, and the
  optional behaviours the conformance kit should test).

Implement hooks as methods decorated with :data:`kvcore.hookimpl`. ``kvcore_query``,
``kvcore_read`` and ``kvcore_write`` are required; the others have documented defaults when
absent. A method decorated with ``hookimpl`` whose name matches no spec (a typo) makes
:func:`kvcore.open_backend` fail. Like pluggy hooks everywhere, an implementation may accept
only the arguments it needs, so new arguments can be added to a spec without breaking
existing backends.

Semantics shared by the data hooks:

- The request is well-formed: kvcore checks it once, where it enters the core (see
  :class:`kvcore.BlockRequest` for what is promised), so a backend need not re-check its shape.

- A request covers blocks ``start_block .. start_block + n`` of one sequence
  (:class:`kvcore.requests.BlockRequest`). Results are counts of *leading* blocks: a prefix
  cache can only use a contiguous run from the first block, so a success after a failure
  does not count.
- Every request has a deadline (``request.deadline``, a ``time.monotonic()`` instant). Return
  what finished by then; never block past it on I/O you can abandon. Copies into or out of
  the caller's buffers that are already in flight must finish before the hook returns: the
  caller reuses the buffers as soon as it gets the answer.
- Failures are results, not exceptions, wherever the backend can tell: return the count that
  succeeded, as :class:`kvcore.Outcome` ``(n, failure="why")`` when the shortfall is a failure
  rather than absence (kvcore then reports a backend error to the engine, not a miss). An
  exception that escapes is caught by kvcore, logged once, counted, and turned into the miss
  result (0) with the failure recorded - except in strict mode, used by tests, where it
  propagates.
- Hooks may be called concurrently from several threads unless the backend declares
  ``Capabilities(concurrent=False)``, in which case kvcore serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import pluggy

from kvcore.requests import BlockRequest

PROJECT_NAME = "kvcore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Hooks every backend must implement.
REQUIRED_HOOKS = ("kvcore_query", "kvcore_read", "kvcore_write")

#: Optional hooks; :meth:`kvcore.Backend.implements` tells whether a backend has one.
OPTIONAL_HOOKS = (
    "kvcore_contains",
    "kvcore_describe",
    "kvcore_names",
    "kvcore_admit",
    "kvcore_evict_to",
    "kvcore_flush_token_index",
    "kvcore_remove",
    "kvcore_clear",
    "kvcore_clear_tenant",
    "kvcore_register_buffer",
    "kvcore_unregister_buffer",
    "kvcore_stats",
    "kvcore_raw_baseline",
    "kvcore_watch",
    "kvcore_close",
)


@hookspec(firstresult=True)
def kvcore_query(request: BlockRequest) -> int:
    """Count the leading blocks of ``request`` that a read could restore now.

    :param request: the blocks to look up. Key-addressed backends check every name in
        ``request.object_names[i]`` (K and V, and the scales for block-wise fp8): a block
        counts only when all its parts are present *for this rank*. Token-addressed backends
        match ``request.token_ids`` from ``request.start_block``. ``host`` and ``device``
        are None.
    :return: ``n`` in ``[0, request.num_blocks]``: blocks ``0 .. n-1`` are all present.
        A block missing in the middle ends the run even if later ones exist.

    ``firstresult``: the backend's answer is the result (one backend per plugin manager).

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 may return :class:`kvcore.Outcome` to report a failure;
       ``request.object_names`` is a :class:`kvcore.keys.NameRows` (rows as before).
    """


@hookspec(firstresult=True)
def kvcore_contains(request: BlockRequest) -> Sequence[bool]:
    """Say, for every block of ``request`` on its own, whether a read could restore it now.

    For callers that need to know about blocks past a gap (vLLM's offloading asks which of a
    request's blocks each tier holds, not only the leading run): one call where a run of
    queries would cost a round trip per gap.

    :param request: as for :func:`kvcore_query` (names, no buffers).
    :return: one bool per block, in order: True when every part of that block is present
        *for this rank*, as :func:`kvcore_query` would count it were it the first block.
        A backend that fails part-way returns what it knows and False for the rest (an
        exception is caught by kvcore: every block False, the failure counted).

    Optional: without it, kvcore answers with one leading-run :func:`kvcore_query` per gap.
    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def kvcore_describe(request: BlockRequest) -> Sequence[bytes | None]:
    """Return what each block of ``request`` said of itself when it was written.

    A writer may give each block a little metadata (:attr:`BlockRequest.block_meta`: its
    engine's block hash, parent hash, token ids); a backend that declares
    ``Capabilities(block_meta=True)`` stores it with the block's objects, verified, and
    returns it here to any process sharing the store, without reading the payload. This is
    how an engine announces blocks another process stored (a router credits every engine
    that can load them), from the store alone.

    :param request: as for :func:`kvcore_query` (names, no buffers).
    :return: one entry per block, in order: the bytes the block was written with, or None
        when the block is absent, was written without metadata, or its metadata does not
        verify (a flipped bit is None, never other bytes). A block's parts carry the same
        metadata; the backend may read it from any one of them.

    Optional (only with ``Capabilities(block_meta=True)``): without it every block is None.
    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def kvcore_names() -> Iterable[str]:
    """List the objects the store holds now: at least every object of this backend's
    namespace (names of other namespaces may be included: callers filter by identity).

    For a process that attaches to a store others already filled and must learn what it
    holds (an engine announcing the blocks it can load to a router) without a query per
    guess. A snapshot: what is stored or removed while it is built may or may not be in it,
    so a caller subscribes to the event stream first and lists second.

    :return: the names, in any order.

    Optional: without it kvcore knows of no listing (``Backend.names`` returns nothing).
    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def kvcore_read(request: BlockRequest) -> int:
    """Copy stored blocks into the request's buffers.

    :param request: for ``io="host"`` backends, ``request.host`` gives one staging region per
        block and part, to be filled with exactly the bytes written under
        ``request.object_names[i][j]``. For ``io="device"`` backends, ``request.device`` gives
        the per-layer cache tensors and the device block ids to fill.
    :return: ``n`` in ``[0, request.num_blocks]``: blocks ``0 .. n-1`` were fully read (every
        part, every byte). Buffers of blocks at and after ``n`` hold unspecified bytes. A
        stored object whose size differs from the region's is a miss, never a partial copy.

    ``request.caller_idle`` True: nothing of the caller's computes while it waits for this
    read, so a client that waits for a transfer by polling may poll from a thread at the
    lowest CPU priority (it then leaves the cores to the threads moving the bytes). False:
    the engine may be computing; a read polled at the lowest priority would wait for it.
    A hint a backend may ignore.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 segmented ``request.host`` buffers (per-layer pieces of the
       engine's own blocks: ``HostBuffers.segments``) for backends declaring
       ``Capabilities(segmented_host=True)``; may return :class:`kvcore.Outcome`.
    .. versionchanged:: 0.3 ``request.caller_idle``.
    """


@hookspec(firstresult=True)
def kvcore_write(request: BlockRequest) -> int:
    """Store the request's blocks, idempotently.

    :param request: the blocks and their bytes (``request.host`` or ``request.device``, as
        for :func:`kvcore_read`). Blocks already stored under the same names hold the same
        bytes (names are content-derived), so a backend may skip them rather than rewrite.
    :return: ``n`` in ``[0, request.num_blocks]``: blocks ``0 .. n-1`` are durably stored
        (per the backend's durability settings) and a later query will count them. Storing
        block ``i`` after failing block ``i-1`` is allowed but does not count.

    The bytes must have been copied out of the buffers before the hook returns: the caller
    reuses them immediately.

    A backend with ``Capabilities(block_meta=True)`` stores ``request.block_meta[i]`` (when
    set) with block ``i``'s objects, for :func:`kvcore_describe`; others ignore it.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 segmented host buffers as for :func:`kvcore_read`; may return
       :class:`kvcore.Outcome` (e.g. ``Outcome(i, "disk full")``).
    .. versionchanged:: 0.3 ``request.block_meta``.
    """


@hookspec(firstresult=True)
def kvcore_admit(request: BlockRequest) -> int:
    """Say how many leading blocks of ``request`` a write would store: the admission policy.

    Writers ask before gathering a write's bytes, so a block the backend would refuse costs
    no copy: kvcore's transfer manager calls this with the blocks a write-back would store
    (those after the stored leading run), then writes only the admitted leading run. A
    backend without this hook admits everything.

    :param request: the blocks offered, as for :func:`kvcore_query` (``host`` and
        ``device`` are None). The backend counts this call as one offer of each block,
        those after the first refusal included; blocks already stored count as admitted.
    :return: ``n`` in ``[0, request.num_blocks]``: blocks ``0 .. n-1`` are admitted. A
        failure (raised or reported) is taken as "admit all": a write then stores what it
        can, as without the hook.

    :func:`kvcore_write` stores what it is given whether or not it was asked about:
    admission is the writer's question, asked once per offer (see :mod:`kvcore.admission`
    for the policies a backend can keep).

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def kvcore_evict_to(sink: Callable[..., Collection[str] | None] | None) -> bool:
    """Offer every object the store evicts to ``sink`` before it leaves the store.

    For a store in front of another (kv_tiered): the lower tier receives exactly what the
    upper one drops, and a block the lower tier could not take stays in the upper one, so no
    block is ever in neither (a crash included). Events (:func:`kvcore_watch`) say *that* an
    object was evicted; by the time a subscriber reads one, its bytes are gone.

    :param sink: called as ``sink(objects, deadline, tenant=...)`` (:mod:`kvcore.evictions`)
        by the write that evicts, with ``objects`` ``[(object name, payload), ...]`` still in
        the store: each payload is the object's verified bytes, valid only during the call
        (the sink copies what it keeps, and must not call back into the backend); ``deadline``
        is the write's (a ``time.monotonic()`` instant, or None); ``tenant`` is whose writes
        stored the objects (one call per tenant; a store that keeps no tenants offers them as
        :data:`kvcore.tenants.DEFAULT_TENANT`'s), so the receiver stores them as that tenant's.
        It returns the names it stored; only those leave the store, the others stay (and the
        write takes only what still fits). A block's parts (K and V, scales) are offered in
        one call. An exception from the sink is counted and logged (nothing leaves), never
        raised into the write. None: stop. :func:`kvcore.evictions.sink_caller` calls a sink
        of any version (without ``tenant``, without ``deadline``).
    :return: True if the backend will call ``sink``; False or None if it cannot.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
       (a sink taking ``objects`` alone and returning None, as first drafted, is called that
       way and taken to have stored everything; one without ``tenant`` is called without it)
    """


@hookspec(firstresult=True)
def kvcore_flush_token_index(request: BlockRequest, resident_on_device: bool) -> int:
    """Update a token index's record of where blocks live, without moving data (seed 003).

    Called after blocks were restored to the device (``resident_on_device=True``) and when a
    host-cache eviction drops them (``False``).

    :param request: ``token_ids`` is the full token path from the root (never just the new
        tokens) and ``start_block`` the first block whose residency changed; ``host`` and
        ``device`` are None. ``block_keys`` may be empty: ``num_blocks`` says how many blocks.
    :param resident_on_device: whether the blocks are now held in the engine's device cache.
    :return: the number of blocks whose record was updated. A backend with no token index
        does not implement this hook; kvcore then returns 0.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def kvcore_remove(request: BlockRequest) -> int:
    """Delete this rank's stored objects of the request's blocks (every part).

    For engines that must drop data: a block found corrupt, a tenant's data on request, a
    store an operator trims by hand. Optional; without it kvcore answers 0 and
    :meth:`kvcore.Backend.implements` says so.

    :param request: the blocks, named as for :func:`kvcore_query`; ``host`` and ``device``
        are None. Token-addressed backends locate them by ``token_ids`` from ``start_block``.
    :return: how many of the request's blocks were stored and are now gone (any blocks, not a
        leading run; blocks that were absent do not count). Afterwards a query counts none of
        them until they are written again, also from another process sharing the store.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def kvcore_clear() -> int:
    """Delete every object stored under this backend's namespace, for every rank.

    An operator's or an engine's reset (FastDeploy's and SGLang's ``clear``). Other namespaces
    sharing the store are untouched. Optional; without it kvcore answers 0.

    :return: how many objects were removed (0 when the store cannot count them).

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def kvcore_clear_tenant(tenant: str) -> int:
    """Delete every object tenant ``tenant`` stored (:mod:`kvcore.tenants`: the tenant a write
    request named), from every process sharing the store, leaving other tenants' untouched.

    An operator's call when a tenant leaves (``kvcore clear --tenant NAME``). It must be
    crash-safe: once it has started, no object of the tenant is served again, also after a
    crash mid-way (the deletion is then finished, never left half done and served). A
    backend that does not know who stored what does not implement it (kvcore then answers
    that it cannot, of kind :attr:`kvcore.FailureKind.UNSUPPORTED`). An unknown tenant (not
    in the store's settings, no object of it held) is answered with
    ``Outcome(0, "<why>", FailureKind.UNKNOWN_TENANT)``: callers decide on the kind, never the
    text.

    :param tenant: the tenant's name (checked by kvcore: :data:`kvcore.tenants.TENANT_NAME`).
    :return: how many objects were removed.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec
def kvcore_register_buffer(ptr: int, nbytes: int) -> None:
    """Announce a host staging region that later requests' buffers will point into.

    Called once per region before the first request that uses it (e.g. so a zero-copy
    transport can register the memory with its NIC). Optional; the default does nothing.

    :param ptr: address of the region's first byte.
    :param nbytes: its length.

    .. versionadded:: 0.1
    """


@hookspec
def kvcore_unregister_buffer(ptr: int) -> None:
    """The region registered at ``ptr`` is about to be freed. Optional.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def kvcore_stats() -> Mapping[str, float]:
    """Backend-specific gauges and counters (bytes stored, objects, evictions, ...).

    :return: a flat mapping of metric name to number, merged into kvcore's own metrics under
        the ``backend_`` prefix. Optional; the default is empty.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def kvcore_raw_baseline(ptr: int, nbytes: int, object_nbytes: int) -> Mapping[str, float]:
    """Measure the underlying store's raw speed, bypassing kvcore, for ``kvcore bench``.

    :param ptr: host memory holding ``nbytes`` bytes to write and read back.
    :param nbytes: total bytes to move.
    :param object_nbytes: the size of one object kvcore would store, for stores whose raw
        API is per object.
    :return: ``{"write_gbps": ..., "read_gbps": ...}`` (either may be absent; GB/s are 10^9
        bytes per second, as in every kvcore figure), measured the way
        an operator would without kvcore: one sequential file in the store's root for a disk
        backend, the vendor client's own batch calls for a remote store. Optional; without it
        ``kvcore bench`` compares against memcpy only.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def kvcore_watch(report: Callable[..., None] | None) -> Collection[str] | None:
    """Start (``report`` given) or stop (``None``) reporting the changes only the backend sees.

    kvcore publishes every write, remove and clear it makes through the backend on the
    backend's event stream (:mod:`kvcore.events`). What it cannot see is what the backend
    does on its own, above all capacity evictions, and, for a store several processes share,
    what the others change. kvcore calls this hook with a callable when the stream gets its
    first subscriber and with ``None`` when the last one leaves (and before ``kvcore_close``),
    so a backend with nobody listening does no work for events. Optional: without it the
    stream carries what kvcore sees.

    Until stopped, the backend calls, from any of its threads::

        report(kind, names, sizes=None, origin="local", tenant=None)

    - ``kind``: ``"evicted"`` (dropped for capacity or expiry), ``"stored"``, ``"removed"``,
      ``"cleared"`` (every object of the namespace is gone) or ``"resync"`` (the backend
      lost track: consumers must forget what they knew);
    - ``names``: the objects' names (empty for ``cleared`` and ``resync``);
    - ``sizes``: each object's payload bytes, or None when unknown;
    - ``origin``: ``"local"`` when this opened backend made the change, ``"peer"`` for
      another process or client sharing the store;
    - ``tenant``: whose objects they are (the tenant the write that stored them named,
      :mod:`kvcore.tenants`), where the backend keeps it; None otherwise.

    ``report`` is cheap (it queues) and never raises for a valid call; call it in the order
    the changes happened.

    :param report: the callable, or None to stop.
    :return: when starting, the kinds the backend reports itself for its own calls as well
        (e.g. ``{"stored", "removed", "evicted", "cleared"}`` for a backend whose report is
        one ordered record of every change); kvcore then does not also publish those kinds
        from the calls it makes. ``None`` or empty: kvcore publishes stored, removed and
        cleared itself, the backend only what kvcore cannot see.

    ``firstresult``: the backend's answer is the result.

    .. versionadded:: 0.3
    """


@hookspec
def kvcore_close() -> None:
    """Release connections, threads and files. Called once; no hook is called afterwards.

    Optional. Exceptions are logged and swallowed.

    .. versionadded:: 0.1
    """
