"""A file's sha256, hashed once per version of the file and remembered.

The conversion cache (loader.py) is keyed by what a file holds, not where it lies: the default
model is installed into every virtual environment afresh (a new path and mtime each time), and
a key of path and mtime left one more 0.7 GB entry per environment behind. Hashing reads the
whole file (about a second a GB), so the digest is remembered in <memo_dir>/<hash of the real
path>, stamped with the file's size, mtime and inode: a changed file is hashed again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


def _stamp(st: os.stat_result) -> str:
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def file_digest(path: str, memo_dir: Path | None) -> str:
    """The hex sha256 of the file at `path`, from the memo in `memo_dir` while the file's stamp
    is unchanged (no memo when `memo_dir` is None or cannot be written)."""
    real = os.path.realpath(path)
    stamp = _stamp(os.stat(real))
    memo = None
    if memo_dir is not None:
        memo = memo_dir / hashlib.sha256(real.encode()).hexdigest()[:24]
        try:
            seen, _, digest = memo.read_text().rpartition(" ")
            if seen == stamp and len(digest) == 64:
                return digest
        except (OSError, ValueError):
            pass
    size = int(stamp.split()[0])
    if size > 1 << 30:
        log.info("hashing %s (%.1f GB; once per version of the file)", os.path.basename(real),
                 size / 1e9)  # fmt: skip
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None and _stamp(os.stat(real)) == stamp:  # not changed while read
        _write_atomic(memo, f"{stamp} {digest}")
    return digest


def _write_atomic(target: Path, text: str) -> None:
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:  # a memo is only a shortcut
        log.debug("could not remember the digest in %s (%s)", target, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
