"""Test-only fault injection into the engine core: `EngineCore(config, faults=Faults(...))`.

Production code never builds a `Faults`; the reliability tests do (their servers start
through `tests/fault_server.py`, which reads PAGED_TEST_* variables into one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("paged")


class InjectedFault(RuntimeError):
    """The exception an injected step failure raises."""


@dataclass(frozen=True)
class Faults:
    fail_token: int | None = None  # a step whose batch has this token in a prompt raises
    step_delay: float = 0.0  # steps sleep this long first (to hold requests in flight) ...
    slow_token: int | None = None  # ... only those whose batch has this token in a prompt


def install(runner: Any, faults: Faults) -> None:
    """Wrap runner.launch with the faults asked for."""
    log.warning("TEST FAULT INJECTION ON: %s", faults)
    launch = runner.launch

    def has(tok: int | None, batch: Any) -> bool:
        return tok is not None and any(tok in r.token_ids[: r.num_prompt_tokens]
                                       for r in batch.reqs)  # fmt: skip

    def launch_with_faults(batch: Any, prev: Any = None) -> Any:
        if faults.step_delay > 0 and (faults.slow_token is None or has(faults.slow_token, batch)):
            time.sleep(faults.step_delay)
        if has(faults.fail_token, batch):
            # The path is there to check that clients never see it.
            raise InjectedFault(f"injected step failure (token {faults.fail_token}) in {__file__}")
        return launch(batch, prev)

    runner.launch = launch_with_faults
