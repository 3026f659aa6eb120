"""kvcore.prefill_profile: an engine's timed prefill steps kept on this machine, so the next
engine of the same model and settings starts its load-or-recompute decisions from them.

Clocks are fake wherever a rate is asserted; the engine's steps are made up from one cost
model (no test depends on how fast this machine is)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from kvcore.estimates import PrefillRate, PrefillStep, ReadRate, pair_cost_of
from kvcore.load_costs import LoadDecider, StoredRun
from kvcore.prefill_profile import (
    MAX_STEPS,
    PROFILE_ENV,
    PrefillProfile,
    ProfileFile,
    default_profile_dir,
    profile_dir,
)

#: bench_vllm's shaped model (6 layers, hidden 256, 8 heads of 128): attention dominates a
#: long prompt
PAIR_COST = pair_cost_of(layers=6, hidden=256, heads=8, kv_heads=8, head_dim=128, intermediate=512)
IDENTITY = {"engine": "test", "model": "shaped", "tokens_per_step": 8192, "device": "cpu"}
BLOCK_TOKENS, BLOCK_BYTES = 32, 768 << 10  # 24 KiB of KV per token


class Clock:
    """Seconds since the epoch, moved by hand (a kept step's ``at`` is the wall clock's)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def warm_engine_s(tokens: int, context: int = 0) -> float:
    """A warm engine's step: 8 ms of overhead, 40 us a token, attention's pairs on top
    (a 4,000-token prompt in about 0.67 s, as the shaped bench's engine computes it)."""
    pairs = tokens * (context + tokens / 2)
    return 0.008 + 4e-5 * tokens + 4e-5 * PAIR_COST * pairs * 0.35


def fresh_rate(clock: Clock) -> PrefillRate:
    """A fresh engine's rate after its warm-up: a 64-token step, cold (three times the
    cost a token it will have warm), and a decode step."""
    rate = PrefillRate(tokens_per_step=8192, pair_cost=PAIR_COST, clock=clock)
    rate.observe_step(0.008 + 3 * (warm_engine_s(64) - 0.008), [(64, 0)])
    rate.observe_step(warm_engine_s(1, 64), [(1, 64)])
    return rate


def earlier_engine(clock: Clock, directory: Path) -> PrefillProfile:
    """An engine that served a warm-up and two long prompts, its profile written."""
    rate = fresh_rate(clock)
    profile = PrefillProfile(rate, directory, IDENTITY, clock=lambda: clock.now)
    for n in (4000, 2500):
        rate.observe_step(warm_engine_s(n), [(n, 0)])
        profile.step_observed()
    profile.save()  # its shutdown
    return profile


def test_a_fresh_engine_seeded_by_the_one_before_it_estimates_a_long_prefill_from_it(
    tmp_path: Path,
) -> None:
    """Issue 60's 1 Gbit/s miss: a fresh engine's only steps were its warm-up's, and their
    extrapolation to a 4,000-token prompt was 2 to 3.5 times what it took, so a load slower
    than recomputing was taken. Seeded with the earlier engine's steps, the estimate is the
    prefill's own and the 0.82 s load is declined; without them it is still taken."""
    clock = Clock()
    earlier_engine(clock, tmp_path)
    actual = warm_engine_s(4000)
    alone = fresh_rate(clock)
    seeded = fresh_rate(clock)
    assert PrefillProfile(seeded, tmp_path, IDENTITY, clock=lambda: clock.now).load() == 3
    assert seeded.seeded == 3 and seeded.figures()["seeded_steps"] == 3
    assert "seeded_steps" not in alone.figures()
    guess, informed = alone.estimate_s(4000), seeded.estimate_s(4000)
    assert guess is not None and informed is not None
    assert guess > 1.5 * actual  # the fresh engine's extrapolation
    assert informed == pytest.approx(actual, rel=0.1)

    def decide(rate: PrefillRate) -> tuple[str, int]:
        store = ReadRate(clock=clock)
        for blocks in (1, 2, 4, 8):  # 121 MB/s, 0.5 ms a call: 125 blocks in about 0.82 s
            store.observe(blocks * BLOCK_BYTES, 0.0005 + blocks * BLOCK_BYTES / 121e6)
        choice = LoadDecider(rate, clock=clock).decide(
            [StoredRun(125, store)],
            block_bytes=BLOCK_BYTES,
            block_tokens=BLOCK_TOKENS,
            start_tokens=0,
            prompt_tokens=4000,
        )
        return choice.why, choice.blocks

    assert decide(alone) == ("auto", 125)
    assert decide(seeded) == ("auto", 0)


def test_the_profile_keeps_each_size_of_step_so_a_long_prefill_outlives_many_short_ones(
    tmp_path: Path,
) -> None:
    clock = Clock()
    profile = earlier_engine(clock, tmp_path)
    rate = profile.rate
    for i in range(500):  # a busy engine's short prompts and decode steps afterwards
        clock.now += 1.0
        rate.observe_step(warm_engine_s(100 + i % 7, 0), [(100 + i % 7, 0)])
        rate.observe_step(warm_engine_s(1, 200), [(1, 200)])
        profile.step_observed()
    assert profile.save()
    doc = json.loads(profile.path.read_text())
    kept = {round(step["tokens"]) for step in doc["steps"]}
    assert {4000, 2500, 64} <= kept
    assert len(doc["steps"]) <= MAX_STEPS
    assert all(step["tokens"] > 1 for step in doc["steps"])  # decode steps are not kept
    assert doc["identity"] == IDENTITY


def test_a_longer_step_is_written_at_once_others_at_most_every_interval(tmp_path: Path) -> None:
    clock = Clock()
    rate = PrefillRate(tokens_per_step=8192, clock=clock)
    profile = PrefillProfile(rate, tmp_path, IDENTITY, save_interval_s=60, clock=lambda: clock.now)

    def step(tokens: int) -> None:
        rate.observe_step(warm_engine_s(tokens), [(tokens, 0)])
        profile.step_observed()

    saved: list[int] = []
    original = profile.save

    def counting_save() -> bool:
        saved.append(len(rate.kept_steps()))
        return original()

    profile.save = counting_save  # type: ignore[method-assign]
    step(64)  # the first step: longer than anything on file
    step(32)  # shorter, within the interval: not yet
    step(2000)  # longer: at once
    clock.now += 61
    step(16)  # the interval passed
    step(8)  # not again
    assert saved == [1, 3, 4]
    # a step kept within the interval, then only decode steps (which keep nothing): written
    # once the interval has passed, not left for the shutdown
    clock.now += 61
    step(12)  # the interval passed at the last write: at once
    step(24)
    rate.observe_step(warm_engine_s(1, 100), [(1, 100)])
    profile.step_observed()
    assert saved == [1, 3, 4, 6]
    clock.now += 61
    rate.observe_step(warm_engine_s(1, 101), [(1, 101)])
    profile.step_observed()
    assert saved == [1, 3, 4, 6, 7]
    rate.observe_step(warm_engine_s(1, 102), [(1, 102)])
    profile.step_observed()  # nothing new: no write
    assert saved == [1, 3, 4, 6, 7]


def test_a_step_far_from_its_size_on_file_is_written_at_once(tmp_path: Path) -> None:
    """The first engine on a machine prefilled the 4,000-token prompt in 1.8 times what it
    takes warm (a fresh machine's first long prefill: 0.53 s, later ones 0.30 s, measured in
    the shaped bench) and wrote it. The engines after it computed that prompt at the warm time,
    but a step no longer than the file's longest waited for the save interval, and they lived
    less than that: the file kept 0.53 s, and a later engine estimated a recompute at nearly
    twice its time and loaded where recomputing won. A step whose time moved more than
    :data:`DRIFT` from its size's on file is now written at once."""
    clock = Clock()
    first = PrefillRate(tokens_per_step=8192, pair_cost=PAIR_COST, clock=clock)
    first_profile = PrefillProfile(first, tmp_path, IDENTITY, clock=lambda: clock.now)
    first.observe_step(1.8 * warm_engine_s(4000), [(4000, 0)])
    first_profile.step_observed()  # longer than anything on file: written
    clock.now += 5

    second = fresh_rate(clock)
    second_profile = PrefillProfile(second, tmp_path, IDENTITY, clock=lambda: clock.now)
    assert second_profile.load() == 1
    second_profile.step_observed()  # its warm-up's steps: new sizes, written
    second.observe_step(warm_engine_s(4000), [(4000, 0)])
    second_profile.step_observed()  # no shutdown save follows: the engine is killed
    clock.now += 5

    on_file = ProfileFile.model_validate_json(second_profile.path.read_text())
    long_steps = [step.seconds for step in on_file.steps if step.tokens == 4000]
    assert long_steps == [pytest.approx(warm_engine_s(4000))], long_steps


def test_a_profile_of_another_engine_or_machine_a_corrupt_or_stale_one_is_no_profile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    earlier = earlier_engine(clock, tmp_path)
    assert earlier.path.parent == tmp_path and earlier.path.suffix == ".json"
    # another identity: another file
    other = PrefillProfile(fresh_rate(clock), tmp_path, {**IDENTITY, "tokens_per_step": 2048})
    assert other.path != earlier.path and other.load() == 0
    # a file naming another identity at this name (a digest collision, a copied file)
    doc = json.loads(earlier.path.read_text())
    earlier.path.write_text(json.dumps({**doc, "identity": {"engine": "else"}}))
    with caplog.at_level(logging.WARNING, logger="kvcore.prefill_profile"):
        assert PrefillProfile(fresh_rate(clock), tmp_path, IDENTITY).load() == 0
    assert "another engine's identity" in caplog.text
    # corrupt: ignored, named in the log, and the next save replaces it
    earlier.path.write_text('{"format": 1, "identity": {}, "steps": [{"tokens": -1')
    rate = fresh_rate(clock)
    profile = PrefillProfile(rate, tmp_path, IDENTITY, clock=lambda: clock.now)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcore.prefill_profile"):
        assert profile.load() == 0
    assert str(earlier.path) in caplog.text
    assert profile.save()
    assert PrefillProfile(fresh_rate(clock), tmp_path, IDENTITY, clock=lambda: clock.now).load()
    # stale: steps older than max_age_s are dropped
    clock.now += 8 * 24 * 3600
    stale = PrefillProfile(fresh_rate(clock), tmp_path, IDENTITY, clock=lambda: clock.now)
    assert stale.load() == 0


def test_a_profile_that_cannot_be_written_is_skipped_never_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    clock = Clock()
    rate = fresh_rate(clock)
    profile = PrefillProfile(rate, blocker / "profiles", IDENTITY, clock=lambda: clock.now)
    assert profile.load() == 0
    rate.observe_step(warm_engine_s(4000), [(4000, 0)])
    profile.step_observed()
    assert profile.save() is False


def test_seeded_steps_join_the_engines_own_and_are_counted(tmp_path: Path) -> None:
    clock = Clock()
    rate = PrefillRate(tokens_per_step=8192, clock=clock)
    steps = [PrefillStep(4000, 8e6, 0.7, 1.0), PrefillStep(0, 0, 1.0, 1.0)]  # one unusable
    assert rate.seed(steps) == 1 and rate.seeded == 1 and rate.samples == 1
    assert rate.kept_steps() == [steps[0]]
    assert rate.known


def test_where_profiles_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_profile_dir() == tmp_path / "xdg" / "kvcore-prefill"
    assert profile_dir("auto") == default_profile_dir()
    assert profile_dir("off") is None
    assert profile_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv(PROFILE_ENV, "off")
    assert profile_dir("auto") is None
    assert profile_dir(str(tmp_path / "mine")) == tmp_path / "mine"  # a setting wins
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "env"))
    assert profile_dir("auto") == tmp_path / "env"
