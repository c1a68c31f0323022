"""paged --help, platforms, env: the commands that need no model."""

from __future__ import annotations

import json
import subprocess

COMMANDS = ("serve", "chat", "complete", "run-batch", "bench", "platforms", "env", "cache")


def test_help_lists_every_command(paged_exe):
    out = subprocess.run([*paged_exe, "--help"], capture_output=True, text=True, check=True)
    for cmd in COMMANDS:
        assert f"    {cmd}" in out.stdout, cmd
    bench = subprocess.run([*paged_exe, "bench", "--help"], capture_output=True, text=True)
    for cmd in ("serve", "throughput", "latency"):
        assert f"    {cmd}" in bench.stdout, cmd


def test_unknown_flags_are_reported_by_the_command_given(cli, capsys):
    """`paged X --bogus`: X's usage and `paged X: error: ...`, exit 2, down to nested commands;
    an unknown flag before any command is paged's own."""
    import pytest

    for cmd in (
        ["serve"], ["chat"], ["complete"], ["run-batch", "-i", "a", "-o", "b"], ["bench"],
        ["bench", "serve"], ["bench", "throughput"], ["bench", "latency"], ["platforms"],
        ["models"], ["env"], ["fleet"], ["fleet", "status"], ["fleet", "ray-resources"],
        ["cache"], ["cache", "list"], ["cache", "clear"], [],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            cli(*cmd, "--bogus")
        _, err = capsys.readouterr()
        name = " ".join(["paged", *cmd[: 2 if cmd[:1] in (["bench"], ["fleet"], ["cache"]) else 1]])
        assert e.value.code == 2, cmd
        assert err.startswith(f"usage: {name} ") and err.endswith(
            f"{name}: error: unrecognized arguments: --bogus\n"
        ), (cmd, err)


def test_platforms_shows_cpu_available(cli, monkeypatch):
    monkeypatch.delenv("PAGED_PLATFORM", raising=False)
    rc, out, _ = cli("platforms")
    assert rc == 0
    assert any(ln.split()[:2] == ["*", "cpu"] and "available" in ln for ln in out.splitlines())
    assert "selected: cpu" in out
    rc, out, _ = cli("platforms", "--json")
    data = json.loads(out)
    assert data["selected"] == "cpu"
    rows = {row["name"]: row for row in data["platforms"]}
    assert rows["cpu"]["available"] is True
    if "cuda" in rows:  # the cuda plugin is installed too: listed, refused with a reason
        assert rows["cuda"]["available"] is False and rows["cuda"]["reason"]


def test_platforms_honours_forcing(cli, monkeypatch):
    rc, out, _ = cli("platforms", "--platform", "nosuch")
    assert rc == 1 and "'nosuch'" in out and "no platform has that name" in out
    monkeypatch.setenv("PAGED_PLATFORM", "cpu")
    rc, out, _ = cli("platforms")
    assert rc == 0 and "forced by PAGED_PLATFORM" in out


def test_env_prints_versions(cli, monkeypatch):
    import torch

    monkeypatch.setenv("PAGED_TEST_VAR", "42")
    monkeypatch.setenv("PAGED_API_KEY", "secret-value")
    rc, out, _ = cli("env")
    assert rc == 0
    for needle in ("paged", "python", "transformers", "triton", "cpu count", "memory"):
        assert needle in out
    assert torch.__version__ in out
    assert any(ln.split() == ["selected", "cpu"] for ln in out.splitlines())
    assert "PAGED_TEST_VAR" in out and "42" in out
    assert "secret-value" not in out  # keys are hidden
    rc, out, _ = cli("env", "--json")
    data = json.loads(out)
    assert data["platforms"]["selected"] == "cpu"
    assert "cpu" in data["plugins (entry points 'paged')"]
