"""Plots for docs/benchmarks.md, drawn from the figures recorded in bench/results/*.md.

Nothing is measured here: each plot reads the tables of one results file (the sections named
below) and writes an SVG into docs/img/. A results file whose layout changed makes this
script fail naming what it could not find, rather than plot something else.

    python bench/plots.py            # needs matplotlib (pip install -e '.[docs]')
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
IMG = ROOT / "docs" / "img"


@dataclass
class Section:
    """One `## ` section of a results file: its heading, tables and other lines."""

    title: str
    tables: list[list[list[str]]] = field(default_factory=list)  # rows of cells, header first
    lines: list[str] = field(default_factory=list)


def sections(name: str) -> list[Section]:
    """The `## ` sections of bench/results/NAME, with their Markdown tables parsed."""
    out: list[Section] = []
    table: list[list[str]] | None = None
    for line in (RESULTS / name).read_text().splitlines():
        if line.startswith("## "):
            out.append(Section(line[3:].strip()))
            table = None
            continue
        if not out:
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if all(re.fullmatch(r":?-+:?", c) for c in cells):
                continue  # the header's separator row
            if table is None:
                table = []
                out[-1].tables.append(table)
            table.append(cells)
        else:
            table = None
            out[-1].lines.append(line)
    return out


def number(text: str) -> float:
    """The first number in a cell ('27,352' -> 27352.0, '316.6 tok/s' -> 316.6)."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", text)
    if m is None:
        raise ValueError(f"no number in {text!r}")
    return float(m.group().replace(",", ""))


def row(table: list[list[str]], label: str) -> list[str]:
    """The row whose first cell starts with `label`."""
    for r in table:
        if r[0].startswith(label):
            return r
    raise LookupError(f"no row {label!r} in a table headed {table[0]}")


def date_of(title: str) -> str:
    m = re.search(r"\((\d{4}-\d{2}-\d{2})[ T]?(\d{2}:\d{2})?", title)
    if m is None:
        raise ValueError(f"no date in {title!r}")
    return f"{m.group(1)[5:]} {m.group(2) or ''}".strip()


# ---- the plots --------------------------------------------------------------------------


def cpu_throughput(plt) -> Path:
    """bench/results/cpu.md: each offline-throughput run, paged's best 64-prompt figure against
    the best HF transformers configuration and llama.cpp (batched, where the run had it)."""
    runs = [s for s in sections("cpu.md")
            if s.title.startswith("Offline throughput, SmolLM2")]  # fmt: skip  (the default model)
    labels, ours, hf, lcpp = [], [], [], []
    for s in runs:
        t = s.tables[0]
        labels.append(date_of(s.title))
        ours.append(
            max(number(r[1]) for r in t if r[0].startswith("paged") and "64 prompts" in r[0])
        )
        hf.append(max(number(r[1]) for r in t if r[0].startswith("HF ")))
        batched = [number(r[1]) for r in t if r[0].startswith("llama.cpp") and "batch 64" in r[0]]
        lcpp.append(batched[0] if batched else 0.0)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = range(len(runs))
    w = 0.27
    ax.bar([i - w for i in x], ours, w, label="paged, 64 prompts (best path)")
    ax.bar(list(x), hf, w, label="HF transformers, best configuration")
    ax.bar([i + w for i in x], lcpp, w, label="llama.cpp, batch 64 (runs that had it)")
    ax.set_xticks(list(x), labels, rotation=30, ha="right")
    ax.set_ylabel("output tokens/s")
    ax.set_title("CPU, 2 cores: SmolLM2-135M Q4_1 GGUF, 64 prompts x 128 tokens")
    ax.legend()
    return save(fig, "cpu-throughput.svg")


def h200(plt) -> Path:
    """bench/results/h200.md: the latest llama-3.1-8b section with a latency table and the
    latest with a throughput table (each run against HF transformers in the same call)."""
    runs = [s for s in sections("h200.md") if "llama-3.1-8b bfloat16" in s.title]

    def last_with(header: str) -> list[list[str]]:
        for s in reversed(runs):
            for t in s.tables:
                if header in t[0]:
                    return t
        raise LookupError(f"no llama-3.1-8b table with a {header!r} column in h200.md")

    lat = last_with("decode ms/token")
    thr = last_with("total tok/s")
    lat_rows = [r for r in lat[1:] if "--no-async" not in r[0]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.barh([short(r[0]) for r in lat_rows], [number(r[2]) for r in lat_rows], color="C0")
    a.set_xlabel("decode ms/token, batch 1, 128 in / 128 out\n(lower is better)")
    a.invert_yaxis()
    b.barh([short(r[0]) for r in thr[1:]], [number(r[4]) for r in thr[1:]], color="C1")
    b.set_xlabel("total tokens/s, 1000 prompts x 256/256\n(higher is better)")
    b.invert_yaxis()
    fig.suptitle("NVIDIA H200, Llama-3.1-8B shape, bfloat16")
    return save(fig, "h200-8b.svg")


def short(label: str) -> str:
    """A table's implementation label, without its parenthesised notes."""
    return re.sub(r"\s*\(.*?\)", "", label).replace(", best of 2", "").replace(", mean", "")


def spec_decode(plt) -> Path:
    """bench/results/spec_decode.md: plain against ngram speculative decoding per run."""
    # the CPU runs: one row per method (the GPU sections compare trees, one row each)
    runs = [s for s in sections("spec_decode.md")
            if s.tables and any(r[0] == "plain" for r in s.tables[0])]  # fmt: skip
    labels, plain, ngram = [], [], []
    for s in runs:
        t = s.tables[0]
        labels.append(s.title.split("(")[0].replace("speculative decoding, ", "").strip())
        plain.append(number(row(t, "plain")[1]))
        ngram.append(number(row(t, "ngram")[1]))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(runs))
    w = 0.38
    ax.bar([i - w / 2 for i in x], plain, w, label="plain decoding")
    ax.bar([i + w / 2 for i in x], ngram, w, label="ngram, k=4")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Speculative decoding on CPU, default model")
    ax.legend()
    return save(fig, "spec-decode.svg")


def fleet(plt) -> Path:
    """bench/results/fleet.md: per fleet and routing policy, the fraction of requests meeting
    both SLOs against the arrival rate (the simulator's per-point lines)."""
    sim = next(s for s in sections("fleet.md") if s.title.startswith("Fleet simulation"))
    curves: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for line in sim.lines:
        m = re.match(r"- (mixed|h200-only) (round-robin|least-load|prefix): (.*)", line)
        if m:
            pts = re.findall(r"([\d.]+): ([\d.]+)/", m.group(3))
            curves[(m.group(1), m.group(2))] = [(float(r), float(f)) for r, f in pts]
    if len(curves) != 6:
        raise LookupError(f"fleet.md: expected 6 per-point lines, found {len(curves)}")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, fleet_name in zip(axes, ("h200-only", "mixed")):
        for policy in ("round-robin", "least-load", "prefix"):
            pts = curves[(fleet_name, policy)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=policy)
        ax.axhline(0.99, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{fleet_name} fleet")
        ax.set_xlabel("arrival rate, requests/s")
    axes[0].set_ylabel("fraction meeting TTFT <= 1 s and TPOT <= 50 ms")
    axes[0].legend()
    fig.suptitle("Fleet routing policies (discrete-event simulation)")
    return save(fig, "fleet-slo.svg")


def pp_cpu(plt) -> Path:
    """bench/results/pp-cpu.md: one rank, two pipeline stages in turn, and micro-batches."""
    t = sections("pp-cpu.md")[-1].tables[0]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r[0] for r in t[1:]], [number(r[1]) for r in t[1:]], color="C2")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (prompt + output)")
    ax.set_title("Pipeline parallelism on CPU, 16 prompts x 512 in / 4 out")
    return save(fig, "pp-cpu.svg")


def save(fig, name: str) -> Path:
    fig.tight_layout()
    path = IMG / name
    fig.savefig(path, metadata={"Date": None})  # no timestamp: reruns give the same file
    return path


PLOTS = [cpu_throughput, h200, spec_decode, fleet, pp_cpu]


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "paged"  # stable element ids
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        path = plot(plt)
        plt.close("all")
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
