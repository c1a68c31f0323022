"""`paged cache`: the conversion cache's entries listed by kind and source file, and removed by
file, all at once, or with the kernel builds; a dry run removes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGED_CACHE_DIR", str(root))
    for kind, name, size in [("weights", "m.Q4_0.gguf-0123456789abcdef", 3000),
                             ("blocks3", "m.Q4_0.gguf-0123456789abcdef", 2000),
                             ("weights-less-aaaaaaaaaaaa", "m.Q4_0.gguf-fedcba9876543210", 500),
                             ("tokenizers", "other-model.gguf-1111111111111111", 40),
                             ("cpu-kernels", "800ec538a769ac39", 7000)]:  # fmt: skip
        entry = root / kind / name
        entry.mkdir(parents=True)
        (entry / "part.bin").write_bytes(b"x" * size)
    (root / "weights" / ".m.Q4_0.gguf-0123456789abcdef.tmp").mkdir()  # being written
    (root / "cpu-kernels" / "800ec538a769ac39.lock").write_text("")
    (root / "digests").mkdir()
    (root / "digests" / "abc").write_text("1 2 3 " + "0" * 64)
    (root / "venv-xla").mkdir()  # not paged's: never listed or removed
    return root


def test_list_shows_every_entry_by_kind_and_source(cli, cache):
    rc, out, _ = cli("cache", "list", "--json")
    got = json.loads(out)
    assert rc == 0 and got["root"] == str(cache) and got["bytes"] == 12540
    assert [(e["kind"], e["name"].rpartition("-")[0] or e["name"], e["bytes"])
            for e in got["entries"]] == [
        ("blocks3", "m.Q4_0.gguf", 2000), ("cpu-kernels", "800ec538a769ac39", 7000),
        ("tokenizers", "other-model.gguf", 40), ("weights", "m.Q4_0.gguf", 3000),
        ("weights-less-aaaaaaaaaaaa", "m.Q4_0.gguf", 500)]  # fmt: skip
    rc, out, _ = cli("cache")  # the table
    assert rc == 0 and "m.Q4_0.gguf" in out and "5 entries, 12.5 KB" in out


def test_clear_by_file_all_and_kernels(cli, cache):
    rc, _, err = cli("cache", "clear")
    assert rc == 1 and "name the files" in err
    rc, out, _ = cli("cache", "clear", "m.Q4_0.gguf", "missing.gguf", "--dry-run")
    assert rc == 0 and out.count("would remove") == 3 and "would free 5.5 KB" in out
    assert "no entries for: missing.gguf" in out and (cache / "weights").iterdir()
    assert len(list((cache / "blocks3").iterdir())) == 1  # the dry run removed nothing
    rc, out, _ = cli("cache", "clear", "m.Q4_0.gguf")
    assert rc == 0 and "freed 5.5 KB" in out
    assert not list((cache / "blocks3").iterdir())
    (left,) = (cache / "tokenizers").iterdir()
    assert left.name == "other-model.gguf-1111111111111111"
    rc, out, _ = cli("cache", "clear", "--all")
    assert rc == 0 and not list((cache / "tokenizers").iterdir())
    assert not (cache / "digests").exists()
    assert (cache / "cpu-kernels" / "800ec538a769ac39").is_dir() and (cache / "venv-xla").is_dir()
    rc, out, _ = cli("cache", "clear", "--kernels")
    assert rc == 0 and not (cache / "cpu-kernels" / "800ec538a769ac39").exists()
    assert (cache / "venv-xla").is_dir()


def test_an_empty_or_missing_cache(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "none"))
    rc, out, _ = cli("cache")
    assert rc == 0 and out.strip().endswith(": empty")
    rc, out, _ = cli("cache", "clear", "--all")
    assert rc == 0 and "freed 0 B" in out
