"""`python tests/fault_server.py [paged serve flags]`: the server with test-only faults in its
engine, read from PAGED_TEST_FAULT_TOKEN, PAGED_TEST_STEP_DELAY and PAGED_TEST_SLOW_TOKEN
(see paged/engine/faults.py)."""

import argparse
import os
import sys

if __name__ == "__main__":  # guarded: the engine's spawned process re-imports this module
    from paged.engine.faults import Faults
    from paged.server.api import add_serve_args, serve_main

    def env_int(name: str) -> int | None:
        v = os.environ.get(name)
        return int(v) if v else None

    faults = Faults(
        fail_token=env_int("PAGED_TEST_FAULT_TOKEN"),
        step_delay=float(os.environ.get("PAGED_TEST_STEP_DELAY") or 0),
        slow_token=env_int("PAGED_TEST_SLOW_TOKEN"),
    )
    parser = argparse.ArgumentParser(prog="fault_server")
    add_serve_args(parser)
    sys.exit(serve_main(parser.parse_args(), faults=faults))
