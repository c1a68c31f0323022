"""Test-only fault injection into the engine core, switched on by environment variables.

    PAGED_TEST_FAULT_TOKEN=ID      a step whose batch holds a request with token ID in its
                                   prompt raises (the step's requests fail, the engine lives)
    PAGED_TEST_STEP_DELAY=SECONDS  steps sleep first (to hold requests in flight): every step,
    PAGED_TEST_SLOW_TOKEN=ID       or only those whose batch holds a prompt with token ID

Read once when the EngineCore starts. Unset (the default), nothing is wrapped and the step
path is untouched.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger("paged")


class InjectedFault(RuntimeError):
    """The exception an injected step failure raises."""


def install_test_faults(runner: Any) -> None:
    """Wrap runner.launch when a PAGED_TEST_* variable asks for a fault."""
    token = os.environ.get("PAGED_TEST_FAULT_TOKEN")
    delay = float(os.environ.get("PAGED_TEST_STEP_DELAY") or 0)
    if token is None and delay <= 0:
        return
    poison = int(token) if token is not None else None
    slow = os.environ.get("PAGED_TEST_SLOW_TOKEN")
    slow_id = int(slow) if slow else None
    log.warning(
        "TEST FAULT INJECTION ON: fault token %s, step delay %.3f s (slow token %s)",
        poison,
        delay,
        slow_id,
    )
    launch = runner.launch

    def has(tok: int | None, batch: Any) -> bool:
        return tok is not None and any(tok in r.prompt_token_ids for r in batch.reqs)

    def launch_with_faults(batch: Any, prev: Any = None) -> Any:
        if delay > 0 and (slow_id is None or has(slow_id, batch)):
            time.sleep(delay)
        if has(poison, batch):
            # The path is there to check that clients never see it.
            raise InjectedFault(f"injected step failure (token {poison}) in {__file__}")
        return launch(batch, prev)

    runner.launch = launch_with_faults
