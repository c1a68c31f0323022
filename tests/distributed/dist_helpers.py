"""What the distributed tests share (tests/distributed is on sys.path: pytest puts a test
file's directory there when it has no __init__.py)."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from paged import SamplingParams

TESTS = Path(__file__).parent.parent


def load_module(name: str, path: Path) -> ModuleType:
    """A helper file of another test directory, imported by path under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def generate_then_kill(llm, kill: Callable[[], None]) -> tuple[BaseException | None, bool, float]:
    """Generate a long batch in a thread and call `kill()` a second in: (what generate raised,
    whether it was still running 60 s later, seconds from the kill until it returned)."""
    err: dict[str, BaseException] = {}
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    def generate() -> None:
        try:
            llm.generate([{"prompt_token_ids": [5, 6]}] * 8, long, use_tqdm=False)
        except BaseException as e:
            err["e"] = e

    t = threading.Thread(target=generate)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    kill()
    t.join(60)
    return err.get("e"), t.is_alive(), time.monotonic() - t0
