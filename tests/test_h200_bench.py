"""bench/h200.py's latency-fp8 phase (issue 15's fp8 floor): the fp8 latency command with its
start-up logged, the start-up lines kept from the log, and the floor judged in the report. The
run itself is faked (no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_bench


def test_the_fp8_phase_keeps_its_start_up_lines_and_judges_the_floor(tmp_path, monkeypatch):
    h200 = load_bench("h200")
    args = h200.parse_args(["--phases", "latency-fp8", "--no-append", "--out", str(tmp_path)])
    (tmp_path / "logs").mkdir()
    ran = []

    def fake_run(name, cmd, timeout, logs, echo=30):
        ran.append(cmd)
        (logs / f"{name}.log").write_text(
            "INFO 2026-12-07 paged: compiled 99 kernel variants for start-up timing in 21.0 s"
            " on 16 threads\nloading\nINFO 2026-12-07 paged: start-up GEMV timing took 30.2 s\n"
        )
        save = Path(cmd[cmd.index("--save-json") + 1])
        save.write_text(json.dumps({"mean_tpot_ms": 2.55, "mean_ttft_ms": 5.0,
                                    "mean_e2el_ms": 330.0}))  # fmt: skip
        return 0

    monkeypatch.setattr(h200, "run", fake_run)
    res = {"latency-fp8": h200.RUNNERS["latency-fp8"](args, tmp_path, 100)}
    (cmd,) = ran
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and "--log-level" in cmd
    assert res["latency-fp8"]["startup"] == [
        "compiled 99 kernel variants for start-up timing in 21.0 s on 16 threads",
        "start-up GEMV timing took 30.2 s",
    ]
    md = h200.report(args, res, "now")
    assert "| paged --quantization fp8, mean | 5.00 | 2.55 |" in md
    assert "fp8 floor (issue 15): decode <= 2.6 ms/token: **pass**" in md
    assert "start-up GEMV timing took 30.2 s" in md
    wo = {"latency-fp8-wo": h200.RUNNERS["latency-fp8-wo"](args, tmp_path, 100)}
    assert "--cuda-fp8-weight-only-decode" in ran[1] and "--quantization" in ran[1]
    md = h200.report(args, {**res, **wo}, "now")
    assert "| paged --quantization fp8 --cuda-fp8-weight-only-decode, mean | 5.00 | 2.55 |" in md
    assert "fp8 floor (issue 15), weight-only decode: decode <= 2.6 ms/token: **pass**" in md


def test_latency_runs_take_a_servers_model_length_when_asked(tmp_path, monkeypatch):
    """--lat-max-model-len reaches every latency command (a server's length sizes its decode
    graphs' attention splits); without it the benchmark keeps its own length."""
    h200 = load_bench("h200")
    (tmp_path / "logs").mkdir()
    ran = []

    def fake_run(name, cmd, timeout, logs, echo=30):
        ran.append(cmd)
        (logs / f"{name}.log").write_text("")
        return 0

    monkeypatch.setattr(h200, "run", fake_run)
    for extra in ([], ["--lat-max-model-len", "32768"]):
        args = h200.parse_args(["--phases", "latency", "--no-append", "--out", str(tmp_path),
                                "--lat-hf-modes", "", *extra])  # fmt: skip
        for phase in ("latency", "latency-fp8"):
            h200.RUNNERS[phase](args, tmp_path, 100)
    (plain, plain_fp8, server, server_fp8) = ran
    assert "--max-model-len" not in plain + plain_fp8
    for cmd in (server, server_fp8):
        assert cmd[cmd.index("--max-model-len") + 1] == "32768"
