"""What a write batch acknowledges when other processes change the store meanwhile.

A write renames its files into place in one native batch, then records them. Between the two,
another process may store the same object and evict or remove it (its file is then ours, at
the same path): the write must not acknowledge a block whose file left. The catalog watches
the records about the objects a write stores (``Catalog.watch_writes``): only those are looked
for on disk when the write records its files, so a write that nobody else touched does no
``lstat`` at all."""

from __future__ import annotations

import os

import kv_file.batch
import kv_file.catalog
import pytest
from kv_file_testutil import object_paths, open_store, query, read_verified, write

pytestmark = pytest.mark.usefixtures("io_path")  # the native batch and the Python path


def _counting_lstats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    looked: list[str] = []
    real = kv_file.catalog._regular_file

    def regular_file(path: str) -> bool:
        looked.append(path)
        return real(path)

    monkeypatch.setattr(kv_file.catalog, "_regular_file", regular_file)
    return looked


def test_a_write_nobody_else_touched_records_its_files_without_looking(
    tmp_path, monkeypatch
) -> None:
    store = open_store(str(tmp_path / "s"))
    looked = _counting_lstats(monkeypatch)
    assert write(store, [f"k{i}" for i in range(8)]) == 8
    assert looked == []
    assert read_verified(store, [f"k{i}" for i in range(8)]) == 8
    store.close()


def test_a_file_removed_between_its_rename_and_its_record_is_not_acknowledged(
    tmp_path, monkeypatch
) -> None:
    root = str(tmp_path / "s")
    writer, other = open_store(root), open_store(root)  # two catalogs: two processes' view
    looked = _counting_lstats(monkeypatch)
    keys = ["a", "b", "c"]
    meddled: list[bool] = []

    def after_the_renames(run):
        def wrapped(*args, **kwargs):
            out = run(*args, **kwargs)
            # once the files of a, b, c are in place (a run that wrote them), not yet recorded
            if not meddled and all(os.path.exists(p) for p in object_paths(writer, "b")):
                meddled.append(True)
                assert write(other, ["b"]) == 1  # the other process stores b too (skipped:
                assert other.remove(other.request("rm", ["b"])) == 1  # it is there), removes it
            return out

        return wrapped

    batches = writer.plugin._batches
    monkeypatch.setattr(batches, "run_native", after_the_renames(batches.run_native))
    monkeypatch.setattr(batches, "run", after_the_renames(batches.run))
    done = write(writer, keys)
    assert meddled
    assert done == 1, "b left before the write recorded it: the run ends at a"
    assert writer.stats()["backend_write_lost"] == 2  # b's two parts
    # only the objects some record was about (b's) were looked for, not a's or c's
    untouched = object_paths(writer, "a") + object_paths(writer, "c")
    assert not set(looked) & set(untouched), looked
    assert set(object_paths(writer, "b")) <= set(looked)
    assert query(writer, keys) == 1 and query(other, keys) == 1
    assert read_verified(writer, ["a"]) == 1
    writer.close()
    other.close()
