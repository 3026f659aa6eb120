"""Fixtures for the connector's tests: a tiny random model, engine processes, prompts.

Engine tests start real vLLM engines (``python -m kvcore_vllm.session``), each in a fresh
process, and compare them with an engine that has no connector. Mooncake tests start a real
``mooncake_master`` on 127.0.0.1; the whole run moves into a loopback-only network namespace
first when it can (Mooncake's client listens on the wildcard address), as kv_mooncake's own
tests do. Set ``KV_MOONCAKE_NETNS=0`` to skip that.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvcore_vllm.session import LOAD_POLICY_ENV, EngineRun, run_in_subprocess, write_model

from kvcore.prefill_profile import PROFILE_ENV

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE.parent
CACHE = PACKAGE_ROOT / ".cache"
BLOCK_SIZE = 32
#: One engine start plus a few tiny prompts takes ~25 s on 2 cores; a hung engine fails here.
ENGINE_TIMEOUT_S = float(os.environ.get("KVCORE_VLLM_ENGINE_TIMEOUT_S", "420"))

_netns_note = "not attempted (KV_MOONCAKE_NETNS=0)"


def pytest_configure(config: pytest.Config) -> None:
    global _netns_note
    # these engines check what a restore delivers: they load whatever is found (the
    # load-or-recompute decision has its own tests, which name their policy)
    os.environ.setdefault(LOAD_POLICY_ENV, "always")
    # and no engine starts from another's prefill profile (a test's decisions would depend on
    # which engines ran before it): the profile's tests name their directory
    os.environ[PROFILE_ENV] = "off"
    if os.environ.get("KV_MOONCAKE_NETNS", "auto") != "0":
        from kv_mooncake.testing import isolate_loopback

        why_not = isolate_loopback()
        _netns_note = "private, loopback only" if why_not is None else f"shared ({why_not})"


#: The files that take longest, started first (seconds of their tests in one run with two
#: workers on 2 cores): the workers take whole files in this order (``--dist loadfile
#: --no-loadscope-reorder``), so the run ends with short files, not one worker running a long
#: file alone while the other idles.
SLOWEST_FILES_FIRST = (
    "test_identity.py",  # 310 s
    "test_benchmarks.py",  # 267 s
    "test_tp_agnostic.py",  # 262 s
    "test_models_mla.py",  # 226 s
    "test_engine.py",  # 202 s
    "test_models_swa.py",  # 191 s
    "test_models_mamba.py",  # 132 s
    "test_tensor_parallel.py",  # 50 s
    "test_kv_events.py",  # 46 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return (
            SLOWEST_FILES_FIRST.index(name)
            if name in SLOWEST_FILES_FIRST
            else len(SLOWEST_FILES_FIRST)
        )

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_report_header(config: pytest.Config) -> str:
    return f"kvcore-vllm network namespace: {_netns_note}"


def favour_mooncake(cluster: Any) -> dict[str, Any]:
    """Keep a test cluster responsive while engines load both cores, and its backend config.

    vLLM's CPU workers keep their cores busy; a starved master answers an RPC after
    kv_mooncake's 3 s default and a put fails (a miss, but a test expecting every block
    stored would see one missing). Best effort: the master gets a higher priority where we
    may raise it (root; not this process, whose engines would inherit it), and RPCs a longer
    bound.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, cluster.master.process.pid, -5)
    return cluster.config(close_timeout_s=2.0, rpc_timeout_ms=20_000)


@dataclass
class Prompts:
    """The token lists every engine test uses (seeded: identical in every process)."""

    a: list[int]  # 600 tokens: 18 full blocks of 32 and a partial one
    b: list[int]  # shares A's first 500 tokens (15 full blocks), then differs
    a_new_tokens: int = 40  # A generates into block 18, so a generated block gets stored
    t2_extra: list[int] = field(default_factory=list)  # a second chat turn after A

    @property
    def shared_full_blocks(self) -> int:
        common = 0
        for x, y in zip(self.a, self.b, strict=False):
            if x != y:
                break
            common += 1
        return common // BLOCK_SIZE


def make_prompts(vocab: int = 512) -> Prompts:
    rng = random.Random(1234)
    a = [rng.randrange(1, vocab) for _ in range(600)]
    b = a[:500] + [(t % (vocab - 1)) + 1 for t in (x + 7 for x in a[500:600])]
    t2_extra = [rng.randrange(1, vocab) for _ in range(50)]
    return Prompts(a=a, b=b, t2_extra=t2_extra)


@pytest.fixture(scope="session")
def prompts() -> Prompts:
    return make_prompts()


#: A shares 70 % of its 600 tokens with C (:func:`prompt_c`)
SHARED_TOKENS = 420


@pytest.fixture(scope="session")
def prompt_c(prompts: Prompts) -> list[int]:
    """A's first :data:`SHARED_TOKENS` tokens, then different ones."""
    a = prompts.a
    return a[:SHARED_TOKENS] + [(t % 510) + 1 for t in (x + 3 for x in a[SHARED_TOKENS:])]


#: A step that sums the connector's counters since the last one
STATS_STEP = {"op": "log_stats", "name": "stats"}


def file_connector(root: Path, namespace: str, **settings: Any) -> dict[str, Any]:
    """The connector's settings for a kv_file store in ``root``."""
    return {
        "backend": "file",
        "backend_config": {"root": str(root)},
        "namespace": namespace,
        **settings,
    }


def generate_step(name: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    """A step generating 8 tokens after ``prompt`` (``fields``: e.g. ``logprobs``)."""
    return {"op": "generate", "name": name, "prompts": [prompt], "max_tokens": 8, **fields}


def file_store_contents(root: Path, namespace: str) -> dict[str, float]:
    """What the kv_file store in ``root`` holds, counted by the backend itself."""
    import kvcore

    backend = kvcore.open_backend(
        "file", {"root": str(root), "rescan_interval_s": 0}, context={"namespace": namespace}
    )
    try:
        stats = backend.stats()
    finally:
        backend.close()
    return {"objects": stats["backend_objects"], "bytes": stats["backend_bytes_used"]}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny random Llama, written once into the package's (git-ignored) cache."""
    return write_model(CACHE / "models" / "tiny", "tiny")


def run_engine(spec: dict[str, Any], workdir: Path, label: str) -> EngineRun:
    """Run one engine process over ``spec``; a failure fails the test with the log's tail.

    The engine core runs inside the session's process unless the spec names an ``executor``
    or sets ``in_process``. vLLM's default layout on a CPU (the engine core and a worker in
    two more processes: the scheduler's and the worker's connector apart, their metadata
    crossing a process boundary, as in production) is what the tests that name ``"executor":
    "mp"`` run (test_engine's stores and restores, tensor parallelism, MLA, TP-agnostic
    restores). Elsewhere the two more processes cost ~20 s per engine (each imports vLLM
    again: 37-41 s per engine against 18-19 s here) and test nothing more."""
    spec = {"block_size": BLOCK_SIZE, "sys_path": [str(HERE)], **spec}
    if "executor" not in spec:
        spec.setdefault("in_process", True)
    try:
        return run_in_subprocess(spec, workdir, label, timeout_s=ENGINE_TIMEOUT_S)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


def chat_steps(prompts: Prompts, prefix: str = "") -> list[dict[str, Any]]:
    """A, then B, then A's second turn, each from an empty vLLM prefix cache."""
    return [
        {
            "op": "generate",
            "name": f"{prefix}A",
            "prompts": [prompts.a],
            "max_tokens": prompts.a_new_tokens,
        },
        {"op": "reset_prefix_cache"},
        {"op": "generate", "name": f"{prefix}B", "prompts": [prompts.b], "max_tokens": 8},
        {"op": "reset_prefix_cache"},
        {
            "op": "generate",
            "name": f"{prefix}T2",
            "prompts": [{"after": f"{prefix}A", "extra": prompts.t2_extra}],
            "max_tokens": 8,
        },
    ]


@pytest.fixture(scope="session")
def baseline(
    model_dir: Path, prompts: Prompts, tmp_path_factory: pytest.TempPathFactory
) -> EngineRun:
    """The same prompts on an engine without the connector: the tokens every run must match."""
    workdir = tmp_path_factory.mktemp("baseline")
    return run_engine(
        {"model": str(model_dir), "connector": None, "steps": chat_steps(prompts)},
        workdir,
        "baseline",
    )
