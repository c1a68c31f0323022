"""paged.logs: one format and one list of levels for every process; configure_logging leaves
a host program's handlers alone, and with paged_too still sets paged's own level."""

from __future__ import annotations

import logging

from paged.logs import LOG_LEVELS, configure_logging


def test_a_configured_host_keeps_its_handlers_and_paged_takes_the_level(monkeypatch):
    root, paged = logging.getLogger(), logging.getLogger("paged")
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # the host configured first
    monkeypatch.setattr(root, "level", logging.WARNING)
    monkeypatch.setattr(paged, "level", logging.NOTSET)
    configure_logging("debug")
    assert root.level == logging.WARNING and paged.level == logging.NOTSET
    configure_logging("debug", paged_too=True)
    assert paged.level == logging.DEBUG and len(root.handlers) == 1
    configure_logging(logging.INFO, paged_too=True)
    assert paged.level == logging.INFO
    assert all(logging.getLevelName(name.upper()) >= 10 for name in LOG_LEVELS)
