"""Serving processes freeze their start-up objects out of the collector and log long pauses."""

from __future__ import annotations

import gc
import logging

from paged.engine import gc_pauses


def test_startup_objects_frozen_and_long_collections_logged(monkeypatch, caplog):
    monkeypatch.setattr(gc_pauses, "LONG_S", 0.0)  # every collection counts as long
    kept = [[i] for i in range(1000)]  # tracked objects alive at "start-up"
    try:
        gc_pauses.freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
        with caplog.at_level(logging.INFO, logger="paged"):
            gc.collect()
        assert any("garbage collection (generation 2) paused" in r.message for r in caplog.records)
    finally:
        gc.unfreeze()
        gc.callbacks.remove(gc_pauses._watch)
