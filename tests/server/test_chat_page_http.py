"""GET / serves the chat page and its static files without the API key (the server here has
one), while the API behind it still needs the key; the page uses relative URLs only, so it
works behind --root-path. The browser test is tests/ui/test_chat_page.py."""

from __future__ import annotations

import re

import httpx

ASSETS = {"/static/chat.js": "javascript", "/static/chat.css": "text/css"}


def test_page_and_assets_need_no_key(server):
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script src="static/chat.js"' in page.text
    assert '<link rel="stylesheet" href="static/chat.css">' in page.text
    # the icon is inline: browsers never ask for /favicon.ico (a 404 in every console)
    assert re.search(r'<link rel="icon" href="data:image/svg\+xml,[^"]+">', page.text)
    for path, kind in ASSETS.items():
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
        assert r.text.strip()
    missing = httpx.get(server.url + "/static/nope.js", timeout=30)
    assert missing.status_code == 404


def test_the_api_still_needs_the_key(server, http):
    for path in ("/v1/models", "/fleet", "/static-not-a-page"):
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 401
    assert http.get("/v1/models").status_code == 200


def test_page_urls_are_relative(server):
    """No root-absolute URL (href="/...", fetch("/...")): behind a proxy with --root-path
    the page at /prefix/ reaches /prefix/v1/... and /prefix/static/..."""
    html = httpx.get(server.url + "/", timeout=30).text
    js = httpx.get(server.url + "/static/chat.js", timeout=30).text
    assert not re.search(r'(href|src)="/', html)
    calls = re.findall(r'\b(?:api|fetch)\("([^"]*)"', js)
    assert set(calls) >= {"v1/models", "fleet", "v1/chat/completions"}
    assert not [c for c in calls if c.startswith("/") or "://" in c]
