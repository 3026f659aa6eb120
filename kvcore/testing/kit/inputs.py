"""Hostile input and configuration: hostile keys are only data, a config error names the
field, and a backend opened without a layout (as tools open it) answers queries or refuses
with a ConfigError that says what it needs."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.errors import ConfigError
from kvcore.registry import open_backend
from kvcore.schemas import Capabilities
from kvcore.testing.harness import Harness
from kvcore.testing.kit.fixtures import KitFixtures, _open_without_layout
from kvcore.testing.kit.marks import exercises

__all__ = ["InputTests"]


class InputTests(KitFixtures):
    """What a backend is given, keys, config or no layout at all, never breaks it."""

    # -- hostile input and configuration ---------------------------------------------------

    @pytest.mark.parametrize(
        "key",
        [
            "../../../../etc/passwd",
            "/absolute/path",
            "a\x00b",
            "x" * 10_000,
            "..",
            ".",
            "名前/\n\t\\",
            "CON",
            "a/../../b",
        ],
        ids=[
            "dotdot",
            "absolute",
            "nul",
            "10k",
            "twodots",
            "dot",
            "unicode-ctrl",
            "con",
            "embedded-dotdot",
        ],
    )
    @exercises("kvcore_write", "kvcore_read")
    def test_hostile_keys_are_data(self, harness: Harness, key: str) -> None:
        seq = harness.new_sequence(1)
        seq.keys[0] = f"{key}{seq.keys[0][:16]}"  # unique per run, still hostile
        written = harness.write(seq)
        assert written in (0, 1)
        if written:
            harness.assert_reads_back(seq, 1)

    @exercises()
    def test_unknown_config_field_is_named(
        self, backend_target: str | type, backend_config: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigError, match="no_such_setting"):
            open_backend(backend_target, {**backend_config, "no_such_setting": 1})

    @exercises()
    def test_bad_config_value_is_named(
        self, backend_target: str | type, backend_config: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigError, match="default_timeout_s"):
            open_backend(backend_target, {**backend_config, "default_timeout_s": -1})

    @exercises("kvcore_query", "kvcore_close")
    def test_opens_without_a_layout_for_queries(
        self,
        backend_target: str | type,
        backend_config: dict[str, Any],
        backend_context: dict[str, Any],
        harness: Harness,
        capabilities: Capabilities,
    ) -> None:
        """Tools that only look up or drop data (``kvcore check``, an operator's script) open
        a backend with ``layout=None``: it answers queries, or refuses with a ConfigError that
        says what it needs - never an AttributeError on None."""
        try:
            bare = _open_without_layout(backend_target, backend_config, backend_context)
        except ConfigError:
            return  # a clear refusal is allowed
        with bare:
            seq = harness.new_sequence(2)
            missing = bare.query(bare.request("kit-no-layout", seq.keys, token_ids=seq.token_ids))
            assert missing == 0
            if capabilities.shared and capabilities.addressing == "key":
                # same config and context but the layout: the same object names (k and v)
                assert harness.write(seq) == 2
                found = bare.query(bare.request("kit-no-layout", seq.keys))
                assert found == 2, "a backend opened without a layout misses stored blocks"
