"""Make the repository root importable (files live flat at the root) and keep tests single-threaded
per rank so the 2-core machine is not oversubscribed. The trainer's caches (--cache-dir's default,
$ATTOTRON_CACHE_DIR) go to the session's temporary folder, never to the home folder."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="session")
def _attotron_cache(tmp_path_factory):
    """Every run's prepared data in this session's folder (forked ranks and subprocesses inherit it)."""
    os.environ.setdefault("ATTOTRON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "attotron-cache"))
