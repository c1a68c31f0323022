"""file_digest: a file's sha256, remembered while the file's size, mtime and inode stay."""

from __future__ import annotations

import hashlib
import os

from paged.model import file_digest as fd


def test_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    f, memo = tmp_path / "m.gguf", tmp_path / "digests"
    f.write_bytes(b"a" * 10_000_000)  # more than one read chunk
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    reads = []
    real_open = open
    monkeypatch.setattr(fd, "open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k),
                        raising=False)  # fmt: skip
    assert fd.file_digest(str(f), memo) == want and len(reads) == 1
    assert fd.file_digest(str(f), memo) == want and len(reads) == 1  # from the memo
    link = tmp_path / "link.gguf"
    link.symlink_to(f)
    assert fd.file_digest(str(link), memo) == want and len(reads) == 1  # one real path
    f.write_bytes(b"b" * 10)
    os.utime(f, ns=(5, 5))
    assert fd.file_digest(str(f), memo) == hashlib.sha256(b"b" * 10).hexdigest()
    assert len(reads) == 2 and len(list(memo.iterdir())) == 1


def test_digest_without_a_writable_memo(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"xyz")
    blocker = tmp_path / "file"
    blocker.write_text("")
    want = hashlib.sha256(b"xyz").hexdigest()
    assert fd.file_digest(str(f), blocker / "digests") == want
    assert fd.file_digest(str(f), None) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "m.gguf"]  # nothing left
