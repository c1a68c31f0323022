"""How paged's processes log: one format and one list of levels for the server, its engine and
worker processes, and the CLIs."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def configure_logging(level: str | int, paged_too: bool = False) -> None:
    """Log at `level` (one of LOG_LEVELS, or a logging number) in LOG_FORMAT, where no handler
    is configured yet (logging.basicConfig). `paged_too`: also set paged's own logger to the
    level, so that it holds where a host program configured logging first."""
    level = level.upper() if isinstance(level, str) else level
    logging.basicConfig(level=level, format=LOG_FORMAT)
    if paged_too:
        logging.getLogger("paged").setLevel(level)
