"""Reliability fixtures: live servers on a tiny random model (fast starts)."""

from __future__ import annotations

import httpx
import pytest
from reliability_helpers import (
    API_KEY,
    AUTH,
    TINY_ARGS,
    Server,
    make_tiny_model,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rel-tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory) -> Server:
    """The tiny model behind PAGED_API_KEY: for bad input and the property-based run."""
    log = tmp_path_factory.mktemp("rel-tiny-server") / "server.log"
    srv = start_server([tiny_model, *TINY_ARGS], log, {"PAGED_API_KEY": API_KEY})
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def tiny_http(tiny_server) -> httpx.Client:
    with httpx.Client(base_url=tiny_server.url, headers=AUTH, timeout=60) as c:
        yield c
