"""Cold start: seconds from launching `paged serve` (default model) to /health answering 200.

    python bench/cold_start.py [--runs 3] [-- extra serve flags]

The first run may also fill the conversion cache (tokenizer, config, dequantized weights);
each run is reported. Results are appended to bench/results/cpu.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
from common import write_results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(extra: list[str], timeout: float = 120.0) -> float:
    port = free_port()
    paged = shutil.which("paged") or os.path.join(os.path.dirname(sys.executable), "paged")
    t0 = time.perf_counter()
    proc = subprocess.Popen([paged, "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"paged serve exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server not ready in time")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="extra flags for paged serve (after --)")
    args = ap.parse_args()
    times = []
    for i in range(args.runs):
        t = one_start(args.extra)
        times.append(t)
        print(f"run {i + 1}: ready in {t:.1f} s", flush=True)
    rows = [(f"run {i + 1}", f"{t:.1f} s to /health 200") for i, t in enumerate(times)]
    rows.append(("best / worst", f"{min(times):.1f} s / {max(times):.1f} s"))
    write_results("cpu.md", "Cold start of `paged serve` (default model) to a ready /health",
                  rows, {"seconds": times})


if __name__ == "__main__":
    main()
