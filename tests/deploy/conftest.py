"""The deployment tests: `-k ray` or `-m ray` selects the ones that start a Ray cluster."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts a local Ray cluster and Ray Serve (needs pagegate[ray])")
