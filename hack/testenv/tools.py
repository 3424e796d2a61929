"""Running the test environment's own kubectl and helm against it, from tests and scripts, and
rendering the chart with its helm (no cluster needed)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from testenv import build

Tool = Callable[..., subprocess.CompletedProcess]
CHART = Path(__file__).resolve().parents[2] / "charts" / "transom"


def render_chart(*args: str, namespace: str = "transom-system", release: str = "transom") -> list[dict]:
    """The chart's objects as `helm template` renders them with extra helm `args` (`--set`
    ...); build.MissingTool when helm was not built."""
    helm = build.bin_dir() / "helm"
    if not helm.exists():
        raise build.MissingTool(f"no helm at {helm}: run `hack/testenv.sh build`")
    out = subprocess.run([str(helm), "template", release, str(CHART), "-n", namespace, *args],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


class CommandFailed(subprocess.CalledProcessError):
    """CalledProcessError whose message carries the command's output, for test reports."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def run_tool(
    binary: Path, args: tuple[str, ...], env: dict[str, str], input: str | None = None,
    check: bool = True, timeout_s: float = 60,
) -> subprocess.CompletedProcess:
    """Run one of the built tools (kubectl, helm) with the given environment added."""
    proc = subprocess.run(
        [str(binary), *args], input=input, capture_output=True, text=True,
        env={**os.environ, **env}, timeout=timeout_s,
    )
    if check and proc.returncode != 0:
        raise CommandFailed(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc


@dataclass(frozen=True)
class KubeTools:
    kubectl: Tool  # kubectl(*args, input=None, check=True, timeout_s=60) -> CompletedProcess (text)
    helm: Tool


def kube_tools(env, helm_home: Path | None = None) -> KubeTools:
    """kubectl and helm for the environment `env` (a cluster.Env); helm's cache, config and
    data live in `helm_home` (a fresh temporary directory by default), not in $HOME."""
    home = helm_home or Path(tempfile.mkdtemp(prefix="transom-helm-"))
    kube = {"KUBECONFIG": str(env.kubeconfig)}
    helm_env = {**kube, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                "HELM_DATA_HOME": str(home / "data")}
    return KubeTools(
        kubectl=lambda *args, **kw: run_tool(env.bin_dir / "kubectl", args, kube, **kw),
        helm=lambda *args, **kw: run_tool(env.bin_dir / "helm", args, helm_env, **kw),
    )
