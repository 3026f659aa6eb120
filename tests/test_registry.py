"""Entry-point discovery, lazy loading and the errors a user sees, on throwaway distributions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_dist import (
    BROKEN_IMPORT_BACKEND,
    GOOD_BACKEND,
    MISSPELLED_BACKEND,
    UNDECORATED_BACKEND,
    make_dist,
    run_module,
    run_python,
)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    make_dist(site, "throwaway-kv", "throwaway_kv", GOOD_BACKEND, {"throwaway": "Backend"})
    return site


def test_throwaway_backend_is_discovered_and_opened(site: Path) -> None:
    out = run_python(
        site,
        """
        import json, kvcore
        names = {b.name: (b.distribution, b.version) for b in kvcore.available_backends()}
        be = kvcore.open_backend("throwaway", {"max_objects": 10})
        print(json.dumps({"names": names, "repr": repr(be), "cfg": be.config.max_objects}))
        be.close()
    """,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["names"]["throwaway"] == ["throwaway-kv", "0.1"]
    assert data["cfg"] == 10


def test_throwaway_backend_passes_the_kit_from_the_command_line(site: Path) -> None:
    out = run_module(
        site,
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--kvcore-backend",
        "throwaway",
        "--kvcore-config",
        '{"max_objects": 100000}',
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "failed" not in out.stdout


def test_listing_does_not_import(site: Path) -> None:
    make_dist(site, "broken-kv", "broken_kv", BROKEN_IMPORT_BACKEND, {"broken": "Backend"})
    out = run_python(
        site,
        """
        import sys, kvcore
        names = [b.name for b in kvcore.available_backends()]
        assert "broken" in names and "throwaway" in names, names
        assert "broken_kv" not in sys.modules and "throwaway_kv" not in sys.modules
        kvcore.open_backend("throwaway").close()   # a broken neighbour does not matter
        print("ok")
    """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_import_failure_says_what_to_install(site: Path) -> None:
    make_dist(site, "broken-kv", "broken_kv", BROKEN_IMPORT_BACKEND, {"broken": "Backend"})
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("broken")
        except kvcore.BackendImportError as e:
            print(e)
    """,
    )
    assert "not_installed_vendor_sdk" in out.stdout
    assert "pip install 'broken-kv'" in out.stdout


def test_unknown_name_lists_installed(site: Path) -> None:
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("nosuch")
        except kvcore.UnknownBackendError as e:
            print(e)
    """,
    )
    assert "'nosuch'" in out.stdout and "throwaway" in out.stdout


def test_duplicate_name_names_both_distributions(site: Path) -> None:
    make_dist(site, "other-kv", "other_kv", GOOD_BACKEND, {"throwaway": "Backend"})
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("throwaway")
        except kvcore.DuplicateBackendError as e:
            print(e)
    """,
    )
    assert "throwaway-kv" in out.stdout and "other-kv" in out.stdout


def test_misspelled_hookimpl_fails_at_open(site: Path) -> None:
    make_dist(site, "typo-kv", "typo_kv", MISSPELLED_BACKEND, {"typo": "Backend"})
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("typo")
        except kvcore.BackendDefinitionError as e:
            print(e)
    """,
    )
    assert "kvcore_raed" in out.stdout


def test_undecorated_hooks_are_reported_missing(site: Path) -> None:
    make_dist(site, "plain-kv", "plain_kv", UNDECORATED_BACKEND, {"plain": "Backend"})
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("plain")
        except kvcore.BackendDefinitionError as e:
            print(e)
    """,
    )
    assert "kvcore_query" in out.stdout and "hookimpl" in out.stdout


def test_bad_config_names_the_field(site: Path) -> None:
    out = run_python(
        site,
        """
        import kvcore
        try:
            kvcore.open_backend("throwaway", {"max_objectz": 3})
        except kvcore.ConfigError as e:
            print(e)
        try:
            kvcore.open_backend("throwaway", {"max_objects": "many"})
        except kvcore.ConfigError as e:
            print(e)
    """,
    )
    assert "max_objectz" in out.stdout
    assert "max_objects:" in out.stdout


def test_environment_overrides_config(site: Path) -> None:
    out = run_python(
        site,
        """
        import kvcore
        print(kvcore.open_backend("throwaway", {"max_objects": 3}).config.max_objects)
    """,
        KVCORE_MEMORY_MAX_OBJECTS="7",
    )
    assert out.stdout.strip() == "7", out.stderr


def test_disabled_backends_are_skipped(site: Path) -> None:
    out = run_python(
        site,
        """
        import kvcore
        print([b.name for b in kvcore.available_backends()])
        try:
            kvcore.open_backend("throwaway")
        except kvcore.UnknownBackendError as e:
            print(e)
    """,
        KVCORE_DISABLE_BACKENDS="throwaway",
    )
    assert "'throwaway'" not in out.stdout.splitlines()[0]
    assert "KVCORE_DISABLE_BACKENDS" in out.stdout


def test_an_opened_instance_may_declare_its_own_capabilities() -> None:
    # a backend made of other backends knows what it can honour only from its config
    from memory_backend import MemoryBackend

    import kvcore
    from kvcore.errors import BackendDefinitionError

    class Narrowed(MemoryBackend):
        def __init__(self, config, context):
            super().__init__(config, context)
            self.capabilities = MemoryBackend.capabilities.model_copy(
                update={"segmented_host": False, "persistent": True}
            )

    backend = kvcore.open_backend(Narrowed)
    assert not backend.capabilities.segmented_host and backend.capabilities.persistent
    assert MemoryBackend.capabilities.segmented_host  # the class's declaration is untouched
    backend.close()

    class Broken(MemoryBackend):
        def __init__(self, config, context):
            super().__init__(config, context)
            self.capabilities = {"addressing": "key"}

    with pytest.raises(BackendDefinitionError, match=r"not a kvcore\.Capabilities"):
        kvcore.open_backend(Broken)
