"""What demo, bench and check share: opening a backend with one-line errors, scratch data."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from kvcore.backend import Backend, VerifyBlocks
from kvcore.cli.errors import CliError, ExitCode
from kvcore.errors import KVCoreError
from kvcore.handles import BackendHandle
from kvcore.schemas import BackendContext

__all__ = ["clear_scratch", "data_location", "open_for_cli", "scratch_namespace"]


def open_for_cli(
    name: str,
    config: dict[str, Any],
    context: BackendContext,
    verify_blocks: VerifyBlocks = "auto",
) -> Backend:
    """Open ``name``; a failure inside the backend's constructor becomes one CLI error.

    kvcore's own errors (unknown name, bad config, broken definition) pass through as they
    are; an ImportError (a vendor SDK imported when the backend opens) is a missing dependency;
    anything else the backend raised while opening (an unreachable server) says so.
    """
    try:
        return BackendHandle(name, config, context=context, verify_blocks=verify_blocks).open()
    except KVCoreError:
        raise
    except ImportError as exc:
        raise CliError(f"backend {name!r} cannot open: {exc}", ExitCode.MISSING_DEPENDENCY) from exc
    except Exception as exc:
        raise CliError(
            f"backend {name!r} cannot open: {type(exc).__name__}: {exc}",
            ExitCode.BACKEND_UNAVAILABLE,
        ) from exc


def scratch_namespace(command: str, given: str | None) -> str:
    """The namespace a run writes under: the one given, or a fresh one per run."""
    return given or f"kvcore-{command}-{uuid.uuid4().hex[:12]}"


def clear_scratch(backend: Backend, keep: bool) -> str:
    """Remove what this run wrote (every object of its namespace) unless ``keep``; returns a
    sentence for the summary saying what happened to the data."""
    where = data_location(backend)
    if keep:
        return f"kept in {where}"
    removed = backend.clear()
    if removed.failure:
        return f"NOT removed ({removed.failure}); it is in {where}"
    count = f"{int(removed)} objects" if int(removed) else "the run's objects"
    return f"removed ({count} of namespace {backend.context.namespace!r} in {where})"


def data_location(backend: Backend) -> str:
    """Where the backend keeps this run's objects, as well as its config says."""
    config = backend.config
    root = getattr(config, "root", None)
    if root is not None:
        # a store under a root keeps each namespace in its own directory (kv_file does)
        sub = getattr(config, "namespace", "") or backend.context.namespace
        return str(Path(str(root)).expanduser() / sub)
    # the settings that say where the data is: whatever was set, secrets left out
    shown = {
        k: v
        for k, v in config.model_dump(mode="json", exclude_defaults=True).items()
        if "password" not in k and "secret" not in k and "token" not in k
    }
    return f"backend {backend.name!r} {json.dumps(shown)}"
