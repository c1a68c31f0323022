"""Structured-output fixtures."""

from __future__ import annotations

import pytest
from structured_helpers import make_tiny_smol


@pytest.fixture(scope="session")
def tiny_smol(tmp_path_factory) -> str:
    return make_tiny_smol(str(tmp_path_factory.mktemp("tiny_smol")))
