"""The docs site: `mkdocs build --strict` passes (links, anchors, nav, API reference), every
nav page is built, and docs/server.md names every route and request field the server has."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def nav_pages(nav: list) -> list[str]:
    """The Markdown paths of mkdocs.yml's nav, in order."""
    out: list[str] = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for v in values:
            out.extend(nav_pages(v) if isinstance(v, list) else [v])
    return out


def built_page(site: Path, md: str) -> Path:
    """Where mkdocs writes a page with directory URLs (a.md -> a/index.html)."""
    stem = md.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return site / f"{stem}.html"
    return site / stem / "index.html"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None]  # fmt: skip
    if missing:
        pytest.skip(f"docs tools not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
    proc = subprocess.run(
        [*cmd, "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def test_every_nav_page_is_built(site: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    for md in ("index.md", "quickstart.md", "offline.md", "server.md", "benchmarks.md"):
        assert md in pages
    for md in pages:
        assert (DOCS / md).is_file(), md
        html = built_page(site, md)
        assert html.is_file(), f"{md} was not built ({html})"
    # Every page under docs/ is in the nav (strict mode refuses omitted files too).
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= set(pages), on_disk - set(pages)


def test_reference_documents_the_public_api(site: Path) -> None:
    html = (site / "reference" / "offline" / "index.html").read_text()
    for anchor in ("paged.LLM", "paged.LLM.generate", "paged.LLM.chat", "paged.SamplingParams"):
        assert f'id="{anchor}"' in html, anchor
    assert "EngineConfig fields" in html  # LLM.__init__'s docstring
    plugins = (site / "reference" / "plugins" / "index.html").read_text()
    for anchor in ("paged.platform.Platform", "paged.model.attention.AttentionBackend"):
        assert f'id="{anchor}"' in plugins, anchor


def test_benchmark_plots_are_committed_and_shown() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\((img/[^)]+)\)", page)
    assert len(images) >= 4
    for img in images:
        assert (DOCS / img).stat().st_size > 1000, img


def code_words(markdown: str) -> set[str]:
    """Every word inside an inline code span of a Markdown text."""
    spans = re.findall(r"`([^`\n]+)`", markdown)
    return {w for s in spans for w in re.findall(r"[A-Za-z_][\w-]*", s)}


def test_server_doc_names_every_route() -> None:
    app = (ROOT / "core" / "paged" / "server" / "app.py").read_text()
    routes = re.findall(r'@app\.(get|post|delete)\("([^"]+)"', app)
    routes += [("get", m + "/...") for m in re.findall(r'app\.mount\("([^"]+)"', app)]
    assert ("post", "/v1/chat/completions") in routes
    doc = (DOCS / "server.md").read_text()
    for method, path in routes:
        shown = re.sub(r"\{[^}]+\}", "{id}", path)
        if path.endswith("/..."):
            assert f"`{shown}" in doc, f"{path} (mounted) is not in docs/server.md"
            continue
        pattern = rf"`{method.upper()} {re.escape(shown)}`|`{re.escape(shown)}`"
        assert re.search(pattern, doc), f"{method.upper()} {path} is not in docs/server.md"


def test_server_doc_names_every_request_field() -> None:
    from pydantic import BaseModel

    from paged.server import anthropic_protocol, protocol, responses_protocol
    from paged.server.serving_embedding import EmbeddingRequest

    bodies = [
        protocol.CompletionRequest,
        protocol.ChatCompletionRequest,
        protocol.TokenizeRequest,
        protocol.DetokenizeRequest,
        protocol.LoadLoRAAdapterRequest,
        protocol.UnloadLoRAAdapterRequest,
        EmbeddingRequest,
        anthropic_protocol.MessagesRequest,
        anthropic_protocol.CountTokensRequest,
        responses_protocol.ResponsesRequest,
    ]

    def nested(annotation) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for a in typing.get_args(annotation) for m in nested(a)]

    words = code_words((DOCS / "server.md").read_text())
    seen: set[type[BaseModel]] = set()
    missing: list[str] = []
    todo = list(bodies)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, f in model.model_fields.items():
            if (f.alias or name) not in words:
                missing.append(f"{model.__name__}.{f.alias or name}")
            todo.extend(nested(f.annotation))
    assert len(seen) > 30  # the nested models were walked
    assert not missing, f"request fields not in docs/server.md: {missing}"
