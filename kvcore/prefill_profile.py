"""An engine's prefill steps kept on this machine, so the next engine of the same model and
settings starts its load-or-recompute decisions from them instead of from nothing.

A fresh engine has timed only short steps (a warm-up prompt, a decode step) when its first long
prompt arrives, and :class:`kvcore.estimates.PrefillRate` must extrapolate from them to a
prefill a hundred times larger: on the CPU engine here that estimate was 2 to 3.5 times the
prefill it then took, which had a load slower than recomputing taken (issue 60's 1 Gbit/s
rate). The engine before it, on the same machine, with the same model and settings, timed long
prefills. :class:`PrefillProfile` keeps those steps in a small JSON file named by the digest of
what sets the engine's speed (the ``identity`` the adapter gives: model shapes, dtype,
parallelism, step budget, device), seeds the next engine's rate from it, and writes this
engine's steps back (merged with the file's: the newest step of each size class wins).

A profile is a cache of measurements, never needed: a missing, unreadable or foreign file is
no profile (logged once), and a write that fails is skipped. It is what the engine measured
on this machine only: a profile from another machine is not read (the identity names the
host's processor and the device), and steps older than ``max_age_s`` are dropped.

.. versionadded:: 0.3
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvcore.estimates import PrefillRate, PrefillStep

__all__ = [
    "PROFILE_ENV",
    "PrefillProfile",
    "ProfileFile",
    "default_profile_dir",
    "profile_dir",
]

log = logging.getLogger(__name__)

#: where profiles are kept when an adapter's ``prefill_profile`` setting is ``auto``: a
#: directory, or ``off``
PROFILE_ENV = "KVCORE_PREFILL_PROFILE"

#: at most this many steps are kept (the newest, by size class)
MAX_STEPS = 64

#: a step whose time differs from its size class's step on file by more than this share is
#: written at once: the next engine would estimate that size that far off (a fresh machine's
#: first long prefill took 0.53 s, later ones 0.30 s; engines that lived less than the save
#: interval left the 0.53 s on file, and the engines after them loaded where recomputing won)
DRIFT = 0.25


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: float = Field(gt=0)
    pairs: float = Field(ge=0)
    seconds: float = Field(gt=0)
    at: float


class ProfileFile(BaseModel):
    """The file's contents (JSON): what the engine is (``identity``, for whoever reads the
    file; its name is the identity's digest) and its steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = 1
    identity: dict[str, Any]
    steps: list[_Step]


def default_profile_dir() -> Path:
    """``$XDG_CACHE_HOME/kvcore-prefill``, else ``~/.cache/kvcore-prefill``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcore-prefill"


def profile_dir(setting: str) -> Path | None:
    """The directory an adapter's ``prefill_profile`` setting names: ``off`` none; ``auto``
    :data:`PROFILE_ENV` where set (a directory or ``off``), else :func:`default_profile_dir`;
    anything else is the directory."""
    if setting == "auto":
        setting = os.environ.get(PROFILE_ENV, "").strip() or "auto"
        if setting == "auto":
            return default_profile_dir()
    if setting == "off":
        return None
    return Path(setting).expanduser()


def _digest(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PrefillProfile:
    """The profile of the engine ``identity`` in ``directory``, for ``rate``.

    :meth:`load` seeds ``rate`` from the file (once, at the engine's start);
    :meth:`step_observed` (after each step the adapter fed ``rate``) writes the file at once
    when ``rate`` kept a step longer than any the file holds or one whose time moved more than
    :data:`DRIFT` from its size class's on file, else at most every
    ``save_interval_s`` while it has newer steps; :meth:`save` writes it now (at shutdown).
    Thread-safe; a write happens on the caller's thread (a file of a few KiB).
    """

    def __init__(
        self,
        rate: PrefillRate,
        directory: Path,
        identity: Mapping[str, Any],
        *,
        save_interval_s: float = 60.0,
        max_age_s: float = 7 * 24 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.rate = rate
        self.identity = dict(identity)
        self.path = directory / f"{_digest(self.identity)}.json"
        self.save_interval_s = save_interval_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        #: size class -> its step on file (``at``, ``seconds``)
        self._saved: dict[tuple[int, int], tuple[float, float]] = {}
        self._saved_at = -float("inf")
        self._most_pairs_saved = -1.0
        self._kept_seen = -1  # rate.kept_changes when last looked at
        self._pending = False  # the rate kept steps the file lacks (written when due)
        self._warned = False

    def load(self) -> int:
        """Seed the rate from the file; the number of steps seeded (0 without a profile)."""
        steps = self._read()
        with self._lock:
            self._remember(steps)
        return self.rate.seed(steps)

    def step_observed(self) -> None:
        """The adapter fed the rate a step: write the file if it now lacks what the rate has
        (nothing to do, at the cost of one comparison, after a step that kept nothing: most
        steps are decode steps)."""
        changes = self.rate.kept_changes
        if changes == self._kept_seen and not (
            self._pending and self._clock() - self._saved_at >= self.save_interval_s
        ):
            return
        self._kept_seen = changes
        kept = self.rate.kept_steps()
        with self._lock:
            new = [s for s in kept if self._saved.get(s.size_class, (-1.0, 0.0))[0] < s.at]
            self._pending = bool(new)
            if not new:
                return
            # a step longer than any on file is what the next engine lacks most, and one whose
            # time moved far from its size's on file corrects what it would estimate: at once
            longer = max(s.pairs for s in new) > self._most_pairs_saved
            moved = any(self._moved(s) for s in new)
            if not (longer or moved) and self._clock() - self._saved_at < self.save_interval_s:
                return
        self.save()

    def save(self) -> bool:
        """Merge the rate's steps into the file (the newest of each size class); whether it
        was written."""
        with self._lock:
            merged = {s.size_class: s for s in self._read()}
            for step in self.rate.kept_steps():
                if step.size_class not in merged or merged[step.size_class].at < step.at:
                    merged[step.size_class] = step
            steps = sorted(merged.values(), key=lambda s: s.at)[-MAX_STEPS:]
            doc = ProfileFile(
                identity=self.identity,
                steps=[
                    _Step(tokens=s.tokens, pairs=s.pairs, seconds=s.seconds, at=s.at) for s in steps
                ],
            )
            self._saved_at = self._clock()
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, temp = tempfile.mkstemp(prefix=".profile-", dir=self.path.parent)
                try:
                    with os.fdopen(fd, "w") as out:
                        out.write(doc.model_dump_json(indent=1))
                    os.replace(temp, self.path)  # readers see the old file or the new one
                except BaseException:
                    Path(temp).unlink(missing_ok=True)
                    raise
            except OSError as exc:
                self._warn(f"cannot write the prefill profile {self.path}: {exc}")
                return False
            self._remember(steps)
            self._pending = False
            return True

    def _moved(self, step: PrefillStep) -> bool:
        """Whether ``step`` took more than :data:`DRIFT` more or less than its size class's
        step on file (lock held)."""
        on_file = self._saved.get(step.size_class)
        return on_file is not None and abs(step.seconds - on_file[1]) > DRIFT * on_file[1]

    def _remember(self, steps: list[PrefillStep]) -> None:
        """``steps`` are what the file holds now."""
        self._saved = {s.size_class: (s.at, s.seconds) for s in steps}
        self._most_pairs_saved = max((s.pairs for s in steps), default=-1.0)

    def _read(self) -> list[PrefillStep]:
        """The file's steps younger than ``max_age_s``; none where it is missing or unusable."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._warn(f"cannot read the prefill profile {self.path}: {exc}")
            return []
        try:
            doc = ProfileFile.model_validate_json(text)
        except ValidationError as exc:
            self._warn(f"ignoring the prefill profile {self.path}: {exc.errors()[0]['msg']}")
            return []
        if doc.identity != json.loads(json.dumps(self.identity, default=str)):
            self._warn(f"ignoring the prefill profile {self.path}: another engine's identity")
            return []
        oldest = self._clock() - self.max_age_s
        return [
            PrefillStep(s.tokens, s.pairs, s.seconds, s.at) for s in doc.steps if s.at >= oldest
        ]

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s (load-or-recompute decisions start from this engine's steps)", message)
