"""The kit on a stack whose write-through copies land late: what it asserts about another
instance's blocks, it asserts only once another instance can see them.

In a memory-over-file-over-file stack an acknowledged block is in this process's memory and
the shared file tier; the copy into the far tier follows in the background. CI once caught the
kit asserting about another rank's blocks before its copy landed (still queued under load):
here that copy is made to lag on purpose, while every other copy lands before its write
returns.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kv_tiered.mover import Copy, Mover

from kvcore.testing import BackendConformance, Harness, harness_opener


def test_the_clear_test_waits_for_no_copy_and_asserts_nothing_unseen(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted = [0]
    run, submit = Mover._run, Mover.submit

    def lagging_second(self: Mover, copy: Copy) -> bool:
        submitted[0] += 1
        if submitted[0] != 2:
            run(self, copy)  # landed before the write returns
            return True

        def late(c: Copy, mover: Mover = self) -> None:
            time.sleep(0.5)
            run(mover, c)

        monkeypatch.setattr(self, "_run", late)
        return submit(self, copy)  # the second write's copy (the other rank's) lags

    monkeypatch.setattr(Mover, "submit", lagging_second)
    kit = BackendConformance()  # the kit's test, run here on one stack
    # memory, then the shared file tier (written before a write is acknowledged: the first
    # persistent tier), then another whose copies follow in the background
    config = {
        "tiers": [
            {"backend": "memory"},
            {"backend": "file", "root": str(tmp_path / "s")},
            {"backend": "file", "root": str(tmp_path / "far")},
        ]
    }
    with harness_opener("tiered", config) as open_:

        def open_harness(layout: Any = None, *, config: Any = None, **context: Any) -> Harness:
            return open_(config, layout, **context)

        kit.test_clear_empties_the_namespace_for_every_rank_and_no_other(open_harness)
    assert submitted[0] >= 3, "the test wrote through fewer instances than it should"
