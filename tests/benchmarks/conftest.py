"""What every benchmark test runs with: the scripts' ranks forked from a preloaded server."""

import pytest


@pytest.fixture(autouse=True)
def forked_ranks(monkeypatch):
    """The scripts' ranks forked from a preloaded server: a tiny run is mostly imports otherwise ([Note: forked
    ranks] in tests/forked.py)."""
    monkeypatch.setenv("LIGHTNING_CHUNK_BENCH_FORK", "1")
