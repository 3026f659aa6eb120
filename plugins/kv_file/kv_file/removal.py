"""Removing objects: ``kvcore_remove`` (a request's blocks), ``kvcore_clear`` (a namespace) and
``kvcore_clear_tenant`` (a tenant's objects, of every namespace).

An object file is unlinked only when :meth:`~kv_file.files.ObjectFiles.look` finds a regular
file at its path; the removals are then made durable per the fsync policy and recorded, so
every process sharing the directory forgets them before its next answer (see
:mod:`kv_file.journal`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from kv_file.files import ObjectFiles, describe, fsync_dir
from kv_file.journal import Kind
from kv_file.objio import read_name
from kv_file.paths import discard
from kvcore import Outcome

__all__ = ["clear_objects", "clear_tenant", "remove_blocks"]

#: a tenant's objects are removed (and their removal recorded) this many at a time
_CLEAR_BATCH = 512
#: passes over a tenant's objects before a clear gives up (each pass removes every object the
#: index holds of it; a failed removal ends the clear, which the next open or scan resumes)
_CLEAR_PASSES = 8


def remove_blocks(
    files: ObjectFiles, object_names: Sequence[Sequence[str]], digest: Callable[[str], int]
) -> int:
    """Unlink the objects named ``object_names`` (per block, per part; ``digest`` gives each
    name's file digest); the blocks of which any object was removed, as an Outcome that says
    why when a removal failed."""
    blocks = 0
    removed: list[int] = []
    failure: OSError | None = None
    for names in object_names:
        gone = False
        for name in names:
            d = digest(name)
            try:
                if unlink_object(files, d):
                    removed.append(d)
                    gone = True
            except OSError as exc:
                failure = failure or exc
        blocks += gone
    removed_durably(files, removed)
    if failure is not None:
        return Outcome(blocks, f"remove failed: {describe(failure)}")
    return blocks


def clear_objects(files: ObjectFiles, name_prefix: bytes, own_directory: bool) -> int:
    """Unlink every object of the directory whose name starts with ``name_prefix``, or every
    object when the directory is the namespace's own, and what no valid object is; the count
    removed, as an Outcome that says why when a removal failed."""
    store_dir = files.store_dir
    strays: list[str] = []
    removed: list[int] = []
    failure: OSError | None = None
    for found in store_dir.scan(strays=strays):
        if not own_directory:
            name = read_name(store_dir.object_path(found.digest))
            if name is not None and not name.startswith(name_prefix):
                continue  # another namespace's object
        try:  # ours, or no valid object of anyone's
            if unlink_object(files, found.digest):
                removed.append(found.digest)
        except OSError as exc:
            failure = failure or exc
    discard_strays(files, strays)
    removed_durably(files, removed)
    files.counters.add("objects_cleared", len(removed))
    if failure is not None:
        return Outcome(len(removed), f"clear failed: {describe(failure)}")
    return len(removed)


def clear_tenant(files: ObjectFiles, tenant: str) -> int:
    """Unlink every object of ``tenant`` (of every namespace in the directory); the count
    removed, as an Outcome that says why when a removal failed.

    Crash-safe: a clearing record goes into the journal first, and from then on no process
    sharing the directory serves an object of the tenant or stores one (its writes are
    refused), until the clear is recorded as finished, with no object of it left. A clear a
    crash interrupted stays in the journal (a compaction keeps it): the next process to open
    the directory, or its next full scan, finishes it. Objects a scan adopts (files no record
    tells of) belong to no tenant's clear: they are the default tenant's.
    """
    catalog = files.catalog
    catalog.clears_running[tenant] += 1
    try:
        return _clear_tenant(files, tenant)
    finally:
        catalog.clears_running[tenant] -= 1


def _clear_tenant(files: ObjectFiles, tenant: str) -> int:
    catalog = files.catalog
    catalog.start_clearing(tenant)
    removed = 0
    failure: OSError | None = None
    for _ in range(_CLEAR_PASSES):
        todo = catalog.index.of_tenant(tenant)
        for start in range(0, len(todo), _CLEAR_BATCH):
            done: list[int] = []
            for digest in todo[start : start + _CLEAR_BATCH]:
                try:
                    if unlink_object(files, digest):
                        done.append(digest)
                except OSError as exc:
                    failure = failure or exc
            removed_durably(files, done)
            removed += len(done)
        if failure is not None or catalog.finish_clearing(tenant):
            break
    files.counters.add("tenant_objects_cleared", removed)
    if failure is not None:
        return Outcome(removed, f"clearing tenant {tenant!r} failed: {describe(failure)}")
    if tenant in catalog.index.clearing:
        return Outcome(removed, f"clearing tenant {tenant!r}: objects kept coming back")
    return removed


def unlink_object(files: ObjectFiles, digest: int) -> bool:
    """Delete the object file of ``digest``; whether there was one (a regular file)."""
    if files.look(digest, None) is None:
        return False
    try:
        os.unlink(files.store_dir.object_path(digest))
    except FileNotFoundError:
        files.catalog.gone([digest])
        return False
    return True


def removed_durably(files: ObjectFiles, digests: list[int]) -> None:
    """Make removals durable (per the fsync policy) and record them: every process
    sharing the directory forgets them before its next answer."""
    if not digests:
        return
    if files.sync_dirs:
        for d in {files.store_dir.subdir(digest) for digest in digests}:
            fsync_dir(d)
    files.catalog.gone(digests, Kind.REMOVED)


def discard_strays(files: ObjectFiles, paths: Iterable[str]) -> None:
    """Remove non-files a scan found under object names (never objects of anyone's)."""
    for path in paths:
        try:
            if discard(path):
                files.counters.add("foreign_removed")
        except OSError as exc:
            files.failures.warning(
                ("discard", type(exc)), "kv_file cannot remove %s: %s", path, describe(exc)
            )
