"""Helpers shared by the benchmark scripts: prompts, machine facts, result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

TOPICS = [
    "the ocean",
    "a lighthouse keeper",
    "prime numbers",
    "black holes",
    "bread baking",
    "the Roman empire",
    "a robot learning to paint",
    "coffee",
    "mountain climbing",
    "the history of chess",
    "volcanoes",
    "a city at night",
    "honey bees",
    "the moon",
    "quantum computers",
    "a lost key",
]
ASKS = [
    "Write a short story about {}.",
    "Explain {} to a child.",
    "Give three facts about {}.",
    "Write a poem about {}.",
]


def chat_prompts(n: int) -> list[list[dict]]:
    """n distinct single-turn chat conversations."""
    convs = []
    for i in range(n):
        ask = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS) + i) % len(TOPICS)])
        convs.append([{"role": "user", "content": ask}])
    return convs


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    host = f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
    gpus = _nvidia_gpus()
    return f"{gpus} on {host}" if gpus else host


def _nvidia_gpus() -> str:
    """'1x NVIDIA H200' from nvidia-smi; empty where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    names = [n.strip() for n in out if n.strip()]
    return f"{len(names)}x {names[0]}" if names else ""


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],  # -dirty: edited tree
            capture_output=True,
            text=True,
            cwd=RESULTS.parent,
        ).stdout.strip()
    except OSError:
        return "?"


def write_results(md_name: str, title: str, rows: list[tuple[str, str]], extra: dict) -> None:
    """Append a dated section to bench/results/<md_name> and a JSON twin."""
    RESULTS.mkdir(exist_ok=True)
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    lines = [
        f"\n## {title} ({now})\n",
        f"- machine: {machine()}",
        f"- commit: {git_rev()}",
        f"- command: `python {cmd}`",
        "",
        "| run | result |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows]
    with open(RESULTS / md_name, "a") as f:
        f.write("\n".join(lines) + "\n")
    stem = md_name.removesuffix(".md")
    with open(RESULTS / f"{stem}-latest.json", "w") as f:
        json.dump({"date": now, "machine": machine(), "command": cmd, **extra}, f, indent=1)
