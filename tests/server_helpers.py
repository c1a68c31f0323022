"""tests/server/conftest.py as a plain module (start_server, stop_server, ENGINE_ARGS, API_KEY)
for fixtures outside tests/server: one module object, whoever loads it first."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "paged_server_conftest"


def server_helpers() -> ModuleType:
    if NAME not in sys.modules:
        path = Path(__file__).with_name("server") / "conftest.py"
        spec = importlib.util.spec_from_file_location(NAME, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = mod
        spec.loader.exec_module(mod)
    return sys.modules[NAME]
