"""Fixtures for e2e tests: a real control plane on loopback (hack/testenv).

One control plane serves the whole session: a running one (`hack/testenv.sh up`) is
reused and left running; otherwise the session starts one and stops it at the end. A tool
that was never built fails the tests with the command that builds it: CI must not pass by
skipping them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import build, cluster  # noqa: E402

from kube_helpers import namespace_name, read_or_none, run_tool, wait_for  # noqa: E402

Tool = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def control_plane() -> Iterator[cluster.Env]:
    env = cluster.current()
    if env is not None:
        yield env  # someone else's: leave it running
        return
    try:
        env = cluster.up()
    except build.MissingTool as e:
        missing = str(e)  # failed outside the handler: one message, no chained traceback
    else:
        missing = None
    if missing is not None:
        pytest.fail(f"the e2e control plane cannot start: {missing}", pytrace=False)
    try:
        yield env
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def kube_api(control_plane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def core_v1(kube_api) -> client.CoreV1Api:
    return client.CoreV1Api(kube_api)


@pytest.fixture
def namespace(request, core_v1) -> Iterator[str]:
    """A fresh namespace per test, named after it; deleted (not awaited) afterwards."""
    name = namespace_name(request.node.name)
    core_v1.create_namespace({"metadata": {"name": name, "labels": {"transom.io/e2e": "true"}}})
    # Pods are refused until the service account controller has made `default`.
    wait_for(lambda: read_or_none(core_v1.read_namespaced_service_account, "default", name), 30,
             f"service account default in namespace {name}")
    yield name
    core_v1.delete_namespace(name)


@pytest.fixture(scope="session")
def kubectl(control_plane) -> Tool:
    """kubectl(*args, input=None, check=True, timeout_s=60) -> CompletedProcess (text)."""
    env = {"KUBECONFIG": str(control_plane.kubeconfig)}

    def run(*args: str, **kwargs):
        return run_tool(control_plane.bin_dir / "kubectl", args, env, **kwargs)

    return run


@pytest.fixture(scope="session")
def helm(control_plane, tmp_path_factory) -> Tool:
    """helm(*args, input=None, check=True, timeout_s=60) -> CompletedProcess (text).

    Helm's cache, config and data live in a session directory, not in the user's home.
    """
    home = tmp_path_factory.mktemp("helm")
    env = {
        "KUBECONFIG": str(control_plane.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str, **kwargs):
        return run_tool(control_plane.bin_dir / "helm", args, env, **kwargs)

    return run
