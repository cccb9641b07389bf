"""Session-wide test fixtures: one throwaway PostgreSQL cluster per test process.

Under pytest-xdist every worker is its own process with its own session, so
each worker gets its own cluster; the temporary directory is prefixed with the
worker id and the port is picked by binding port 0, so workers never collide.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from scry.devcluster import DevCluster, DevClusterError, find_pg_bindir


def _worker_id() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_report_header(config: pytest.Config) -> str:
    try:
        return f"postgresql binaries: {find_pg_bindir()}"
    except DevClusterError as e:
        return f"postgresql binaries: MISSING ({e})"


@pytest.fixture(scope="session")
def pg() -> Iterator[DevCluster]:
    """A running :class:`DevCluster` shared by the whole session (per xdist worker)."""
    try:
        cluster = DevCluster(prefix=f"scry-pg-{_worker_id()}-")
        cluster.start()
    except DevClusterError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
