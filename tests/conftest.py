"""One Ray for the whole session; each test gets its own broker namespace and directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid

import pytest

from raymq.config import apply_ray_env_defaults
from tests import background
from tests.module_broker import ModuleBroker

# Quiet and quick: no dashboard, no usage stats, short metrics interval.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
apply_ray_env_defaults()  # the suite starts Ray itself, as RayMQ would


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the whole-system scenarios this session will check (tests/background.py),
    in the order the suite reaches them, beside the rest of the suite."""
    if not session.config.option.collectonly:
        background.start([item.path.name for item in session.items])


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray for the session, removed afterwards with its temp files."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rmq-ray-")
    ray.init(
        num_cpus=4,
        object_store_memory=200 * 2**20,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def paging_dir(tmp_path):
    """A fresh paging directory for one test."""
    d = tmp_path / "paging"
    d.mkdir()
    return str(d)


@pytest.fixture
def broker_factory(ray_session, paging_dir):
    """Make brokers in fresh namespaces; all are shut down after the test."""
    import raymq

    made = []

    def make(**config):
        config.setdefault("paging_directory", paging_dir)
        b = raymq.connect(namespace=f"raymq-test-{uuid.uuid4().hex[:8]}", **config)
        made.append(b)
        return b

    yield make
    for b in made:
        with contextlib.suppress(Exception):
            b.shutdown()


@pytest.fixture(scope="module")
def _module_broker(ray_session, tmp_path_factory):
    shared = ModuleBroker(lambda: tmp_path_factory.mktemp("paging"))
    yield shared
    shared.close()


@pytest.fixture
def broker(_module_broker):
    """A broker with no queue and no address, shared by the module's tests (emptied after
    each). Its paging directory is ``broker.config.paging_directory``, not ``paging_dir``."""
    yield _module_broker.get()
    _module_broker.empty()
