"""The reliability suite's helpers for the server tests (`import rel`): start and stop a
server, read a metric, make a tiny model (tests/reliability/reliability_helpers.py, loaded by
path: that directory is not on sys.path while these tests are collected)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "paged_reliability_helpers",
    Path(__file__).parents[1] / "reliability" / "reliability_helpers.py",
)
_helpers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _helpers  # dataclasses look their module up by name
_spec.loader.exec_module(_helpers)

Server = _helpers.Server
make_tiny_model = _helpers.make_tiny_model
metric = _helpers.metric
start_server = _helpers.start_server
stop_server = _helpers.stop_server
