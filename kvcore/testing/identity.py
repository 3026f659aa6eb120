"""The key-identity kit: requests that must never share a stored block, and requests that must.

A stored block may be served only to a request whose KV is byte for byte what the block holds.
The backend kit (:class:`kvcore.testing.BackendConformance`) proves a store keeps what it is
given; this kit proves an *engine adapter* asks for the right thing: that its keys carry every
part of a request's identity the engine has (``cache_salt``, LoRA adapter, multimodal items,
prompt embeddings) and every engine setting that changes K/V (RoPE, weights, dtype, ...).

An adapter's tests subclass :class:`IdentityDriver` (how to store a batch of requests through
the adapter, then serve probes from a *fresh* engine or process of each configuration) and
call :func:`check_identity`::

    class MyDriver(IdentityDriver):
        name = "my-engine"
        request_axes = frozenset({"cache_salt", "lora"})
        engine_variants = {"rope": "rope-20000", "weight_version": "v2"}

        def serve(self, stored, probes):
            ...  # one storing engine for ``stored``, one fresh engine per configuration
            return {probe.id: Served(restored_tokens=..., restorable_tokens=..., ...)}

    def test_identity():
        report = check_identity(MyDriver())
        assert report.pairs >= 10

Every case has its own prompt, so cases never see each other's blocks and one storing engine
plus one reading engine per configuration serve the whole matrix. A case passes when:

- **apart** (the two requests' KV differs): the probe restores 0 tokens;
- **shared** (the same KV): the probe restores every token a full hit restores;
- and, where the driver reports generated tokens, the probe's tokens equal those of the same
  configuration without the adapter (a wrong block shows as a wrong token).

.. versionadded:: 0.3
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "REQUEST_AXES",
    "Case",
    "IdentityDriver",
    "IdentityReport",
    "Request",
    "Served",
    "check_identity",
    "identity_cases",
    "run_identity_kit",
]

#: Parts of a request's identity an engine may carry per request (the adapter declares which
#: of them it expresses in :attr:`IdentityDriver.request_axes`).
REQUEST_AXES = ("cache_salt", "lora", "mm", "prompt_embeds")

#: The configuration every stored request and the request-level probes run on.
BASE = "base"


@dataclass(frozen=True)
class Request:
    """One request as the kit describes it; the driver turns it into the engine's own.

    ``mm`` and ``prompt_embeds`` name an item (an image, a set of embeddings): two requests
    with the same name carry the same item, with different names different items behind the
    same token ids (an image's placeholder tokens, embeddings' dummy ids). Cases are kept apart
    by their tokens, so a driver whose item replaces the tokens (embeddings given instead of
    token ids) derives it from the name *and* the tokens.
    """

    id: str
    tokens: tuple[int, ...]
    cache_salt: str | None = None
    lora: str | None = None
    mm: str | None = None
    prompt_embeds: str | None = None
    engine: str = BASE


@dataclass(frozen=True)
class Served:
    """What serving one probe did."""

    restored_tokens: int  # tokens the adapter restored from the store
    restorable_tokens: int  # tokens a full hit of the stored request restores
    tokens: tuple[int, ...] | None = None  # generated tokens, where the driver generates
    baseline: tuple[int, ...] | None = None  # the same configuration without the adapter


@dataclass(frozen=True)
class Case:
    name: str
    axis: str
    stored: Request
    probe: Request
    share: bool


@dataclass
class IdentityReport:
    driver: str
    cases: list[Case]
    failures: list[tuple[Case, str]] = field(default_factory=list)

    @property
    def pairs(self) -> int:
        return len(self.cases)

    def by_axis(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for case in self.cases:
            out[case.axis] = out.get(case.axis, 0) + 1
        return out

    def failed_axes(self) -> set[str]:
        return {case.axis for case, _ in self.failures}

    def summary(self) -> str:
        lines = [
            f"identity kit on {self.driver}: {self.pairs} pairs "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.by_axis().items()))}), "
            f"{len(self.failures)} failed"
        ]
        lines += [f"  {case.name}: {why}" for case, why in self.failures]
        return "\n".join(lines)


class IdentityDriver(ABC):
    """How the kit reaches one engine adapter."""

    #: a label for reports
    name: str = "adapter"
    #: the parts of :data:`REQUEST_AXES` the engine carries and the adapter must key by
    request_axes: frozenset[str] = frozenset()
    #: engine-level axes: axis -> the name of a configuration that differs from ``base`` in it
    #: alone (other RoPE settings, weight version, dtype, block size, model, layout, ...)
    engine_variants: Mapping[str, str] = {}
    #: two values per request axis: the first is stored, the second differs
    values: Mapping[str, tuple[str, str]] = {
        "cache_salt": ("tenant-a", "tenant-b"),
        "lora": ("adapter-a", "adapter-b"),
        "mm": ("image-a", "image-b"),
        "prompt_embeds": ("embeds-a", "embeds-b"),
    }
    #: the prompts' length and token range
    prompt_tokens: int = 128
    vocab: int = 500
    seed: int = 0

    @abstractmethod
    def serve(self, stored: Sequence[Request], probes: Sequence[Request]) -> Mapping[str, Served]:
        """Store every request of ``stored`` (configuration ``base``) through the adapter, then
        serve every probe from a *fresh* engine (or process) of the probe's configuration, each
        from an empty engine-side prefix cache; return what serving each probe did, by id."""


def _prompt(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab) for _ in range(n))


def identity_cases(driver: IdentityDriver) -> list[Case]:
    """The matrix for what ``driver`` declares: per case a fresh prompt, a stored request and
    a probe that must be kept apart from it, or must share its blocks."""
    unknown = set(driver.request_axes) - set(REQUEST_AXES)
    if unknown:
        raise ValueError(f"request_axes: {sorted(unknown)} are not among {REQUEST_AXES}")
    rng = random.Random(driver.seed)
    cases: list[Case] = []

    def add(
        name: str, axis: str, stored: dict[str, Any], probe: dict[str, Any], share: bool
    ) -> None:
        tokens = _prompt(rng, driver.prompt_tokens, driver.vocab)
        cid = f"{len(cases):02d}-{name}"
        cases.append(
            Case(
                name=cid,
                axis=axis,
                stored=Request(id=f"{cid}/stored", tokens=tokens, **stored),
                probe=Request(id=f"{cid}/probe", tokens=tokens, **probe),
                share=share,
            )
        )

    add("same-request-fresh-process", "same", {}, {}, True)
    for axis in REQUEST_AXES:
        if axis not in driver.request_axes:
            continue
        a, b = driver.values[axis]
        add(f"{axis}-same", axis, {axis: a}, {axis: a}, True)
        add(f"{axis}-other", axis, {axis: a}, {axis: b}, False)
        add(f"{axis}-stored-probe-without", axis, {axis: a}, {}, False)
        add(f"{axis}-stored-without-probe-with", axis, {}, {axis: a}, False)
    if {"lora", "cache_salt"} <= set(driver.request_axes):
        # an untagged identity confuses an adapter's name with a tenant's salt (vLLM #44701)
        name = driver.values["lora"][0]
        add("lora-name-vs-salt-of-that-name", "lora", {"lora": name}, {"cache_salt": name}, False)
    for axis, engine in driver.engine_variants.items():
        add(f"{axis}-other-engine", axis, {}, {"engine": engine}, False)
    return cases


def run_identity_kit(driver: IdentityDriver) -> IdentityReport:
    """Serve the matrix through ``driver``; every case judged (see the module docstring)."""
    cases = identity_cases(driver)
    served = driver.serve([c.stored for c in cases], [c.probe for c in cases])
    report = IdentityReport(driver=driver.name, cases=cases)
    for case in cases:
        got = served.get(case.probe.id)
        if got is None:
            report.failures.append((case, "the driver did not serve the probe"))
            continue
        if case.share:
            if got.restorable_tokens <= 0:
                report.failures.append((case, "a full hit would restore nothing: vacuous"))
            elif got.restored_tokens != got.restorable_tokens:
                report.failures.append(
                    (
                        case,
                        f"must share: restored {got.restored_tokens} of "
                        f"{got.restorable_tokens} tokens",
                    )
                )
        elif got.restored_tokens != 0:
            report.failures.append(
                (case, f"must stay apart: restored {got.restored_tokens} tokens of another KV")
            )
        if got.tokens is not None and got.baseline is not None and got.tokens != got.baseline:
            report.failures.append(
                (case, f"generated {list(got.tokens)}, without the adapter {list(got.baseline)}")
            )
    return report


def check_identity(driver: IdentityDriver) -> IdentityReport:
    """:func:`run_identity_kit`, raising AssertionError with every failed case."""
    report = run_identity_kit(driver)
    if report.failures:
        raise AssertionError(report.summary())
    return report


def without(request: Request, axis: str) -> Request:
    """``request`` with one part of its identity dropped (what a broken adapter sees)."""
    dropped: dict[str, Any] = {axis: None}  # a field named at run time: checked by replace()
    return replace(request, **dropped)
