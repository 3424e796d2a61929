"""Container images for the test cluster's real kubelets, built offline as OCI archives.

There is no registry and no Docker engine here, so each image is one deterministic layer
in an OCI image-layout tar (oci.py) that containerd 1.6 imports with
`ctr -n k8s.io images import ARCHIVE`.

- `PAUSE_IMAGE`: the sandbox image, a static C `pause` compiled from pause.c;
  `COREDNS_IMAGE`, `PROMETHEUS_IMAGE`, `KUEUE_IMAGE`: the static binaries build.py builds.
- `OPERATOR_IMAGE` (the coordinators' too): images/operator.Dockerfile built as written
  (dockerfiles.py: buildah, offline, on a Debian-made stand-in for its base image).
- `TRAINER_TEST_IMAGE` (tests only): an empty merged-/usr root meant to run the project
  venv from the host through the hostPath mounts `trainer_test_mounts` lists (torch is
  several GB; copying it into an image would gain nothing on a one-machine cluster).

`build_images()` writes them to `build.cache_root()/images` and rebuilds an archive only
when a hash of its inputs changed. `dependency_closure` (what `pip install ".[extras]"`
brings, from the project venv's metadata) is images/constraints.txt's source too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from testenv import build, dockerfiles, oci
from testenv.oci import Rootfs

ROOT = Path(__file__).resolve().parents[2]
PAUSE_SOURCE = Path(__file__).resolve().parent / "pause.c"

PAUSE_IMAGE = "transom.local/pause:3.10"
COREDNS_IMAGE = f"transom.local/coredns:{build.COREDNS_VERSION}"
PROMETHEUS_IMAGE = f"transom.local/prometheus:{build.PROMETHEUS_VERSION}"
KUEUE_IMAGE = f"transom.local/kueue:{build.KUEUE_VERSION}"
OPERATOR_IMAGE = dockerfiles.OPERATOR_IMAGE  # the chart's default image
TRAINER_TEST_IMAGE = "transom.local/trainer-hostvenv:test"

NONROOT = 65532  # distroless's "nonroot", the user the Dockerfiles run as
PAUSE_USER = 65535  # the upstream pause image's user


def merged_usr(fs: Rootfs) -> None:
    """Debian 12's layout: /bin, /sbin, /lib and /lib64 are links into /usr."""
    for name in ("bin", "sbin", "lib", "lib64"):
        fs.dir(f"usr/{name}")
        fs.symlink(name, f"usr/{name}")


def users(fs: Rootfs) -> None:
    """Root's entries alone, as python:3.11-slim has them: the images run as uid 65532, which
    no passwd entry names there either (getpass.getuser() raises for it, kopf's default
    identity did), so what works here works in the image users build."""
    fs.file("etc/passwd", data=b"root:x:0:0:root:/root:/sbin/nologin\n")
    fs.file("etc/group", data=b"root:x:0:\n")
    fs.dir("tmp", 0o1777)


# ------------------------------------------------- the Dockerfile and the project venv


@dataclass(frozen=True)
class Venv:
    path: Path  # the venv's real directory (.venv is a link to it)
    base_prefix: Path  # the Python installation it was made from
    python: str  # "3.11"

    @property
    def site_packages(self) -> Path:
        return self.path / "lib" / f"python{self.python}" / "site-packages"


def project_venv(checkout: Path = ROOT) -> Venv:
    cfg_path = (checkout / ".venv").resolve() / "pyvenv.cfg"
    if not cfg_path.exists():
        raise build.MissingTool(f"the project venv is missing ({checkout / '.venv'}): run `make install`")
    cfg = dict(line.split(" = ", 1) for line in cfg_path.read_text().splitlines() if " = " in line)
    version = cfg.get("version") or cfg["version_info"]
    return Venv(cfg_path.parent, Path(cfg["home"]).resolve().parent, ".".join(version.split(".")[:2]))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors packaging, and every venv has pip
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def installed_distributions(site: Path) -> dict[str, importlib.metadata.Distribution]:
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if dist.metadata["Name"]:
            found.setdefault(_canonical(dist.metadata["Name"]), dist)
    return found


def dependency_closure(extras: Iterable[str], site: Path,
                       root: str = "transom") -> dict[str, importlib.metadata.Distribution]:
    """The distributions that `pip install ".[extras]"` brings besides `root` itself: its
    requirements and the extras', recursively, with environment markers evaluated for the
    running interpreter (the venv's: the image's Python is the same build)."""
    requirement = _requirement_class()
    installed = installed_distributions(site)
    closure: dict[str, importlib.metadata.Distribution] = {}
    todo, seen = [(root, frozenset(extras))], set()
    while todo:
        name, wanted = todo.pop()
        key = _canonical(name)
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        if key not in installed:
            raise build.MissingTool(f"{name} is not installed in {site}: run `make install`")
        if key != _canonical(root):
            closure[key] = installed[key]
        for line in installed[key].requires or ():
            req = requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
                todo.append((req.name, frozenset(req.extras)))
    return dict(sorted(closure.items()))


# ------------------------------------------------------------ the small images


def pause_binary() -> Path:
    out = build.cache_root() / "images" / "pause"
    if shutil.which("gcc") is None:
        raise build.MissingTool("gcc is not installed: `apt-get install -y gcc libc6-dev`")
    out.parent.mkdir(parents=True, exist_ok=True)
    build._run(["gcc", "-static", "-Os", "-s", "-o", str(out), str(PAUSE_SOURCE)])
    return out


def pause_rootfs() -> tuple[Rootfs, dict]:
    fs = Rootfs()
    fs.file("pause", source=pause_binary(), mode=0o755)
    return fs, {"User": str(PAUSE_USER), "Entrypoint": ["/pause"]}


def coredns_binary() -> Path:
    return _built("coredns")


def prometheus_binary() -> Path:
    return _built("prometheus")


def kueue_binary() -> Path:
    return _built("kueue")


def _built(name: str) -> Path:
    path = build.bin_dir() / name
    if not path.exists():
        raise build.MissingTool(f"{path} is not built yet: run `hack/testenv.sh build`")
    return path


def _size_and_mtime(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def coredns_rootfs() -> tuple[Rootfs, dict]:
    fs = Rootfs()
    fs.file("coredns", source=coredns_binary(), mode=0o755)
    fs.dir("etc")  # the kubelet mounts the Corefile's ConfigMap and resolv.conf here
    fs.dir("tmp", 0o1777)
    return fs, {"User": str(NONROOT), "Entrypoint": ["/coredns"]}


def prometheus_rootfs() -> tuple[Rootfs, dict]:
    fs = Rootfs()
    fs.file("bin/prometheus", source=prometheus_binary(), mode=0o755)
    for name in ("etc", "prometheus"):  # the configuration's ConfigMap and the TSDB's emptyDir
        fs.dir(name)
    fs.dir("tmp", 0o1777)
    return fs, {"User": str(NONROOT), "Entrypoint": ["/bin/prometheus"]}


def kueue_rootfs() -> tuple[Rootfs, dict]:
    fs = Rootfs()
    fs.file("bin/kueue", source=kueue_binary(), mode=0o755)
    # /etc/kueue-config: its Configuration's ConfigMap; /etc/kueue/{metrics,webhook}/certs: the
    # certificates' Secret, at the metrics path main.go hard-codes when it manages none itself.
    for name in ("etc/kueue-config", "etc/kueue/metrics/certs", "etc/kueue/webhook/certs"):
        fs.dir(name)
    fs.dir("tmp", 0o1777)
    return fs, {"User": str(NONROOT), "Entrypoint": ["/bin/kueue"]}


def trainer_rootfs() -> tuple[Rootfs, dict]:
    """Almost nothing: the host's /usr, Python, venv and checkout are mounted at run time."""
    fs = Rootfs()
    merged_usr(fs)
    users(fs)
    for name in ("proc", "sys", "dev", "run", "root", "work"):
        fs.dir(name)
    venv = project_venv()
    # WorkingDir as images/trainer.Dockerfile's, where the pods mount examples/.
    return fs, {"User": str(NONROOT), "Env": [f"PATH={venv.path}/bin:/usr/bin:/bin", "HOME=/tmp"],
                "WorkingDir": "/opt/transom"}


def trainer_test_mounts(checkout: Path = ROOT) -> list[tuple[str, str]]:
    """(host path, container path) of each hostPath mount a pod of TRAINER_TEST_IMAGE needs
    for the venv's python to run: the venv's real directory, the Python it was made from,
    /usr (the C libraries and the loader) and the checkout (transom is an editable install)."""
    checkout = checkout.resolve()
    venv = project_venv(checkout)
    dist = installed_distributions(venv.site_packages).get("transom")
    url = json.loads((dist.read_text("direct_url.json") if dist else None) or "{}").get("url", "")
    if url and url != f"file://{checkout}":
        raise build.MissingTool(f"the venv's transom is installed from {url}, not {checkout}: run `make install`")
    dirs: list[Path] = []
    for d in sorted({venv.path, venv.base_prefix, Path("/usr"), checkout}, key=lambda p: len(p.parts)):
        if not any(d.is_relative_to(outer) for outer in dirs):
            dirs.append(d)  # one inside another is mounted with it
    return [(str(d), str(d)) for d in sorted(dirs)]


# --------------------------------------------------------------------- building


@dataclass(frozen=True)
class _Recipe:
    ref: str
    name: str  # the archive's file name, without .oci.tar
    inputs: Callable[[], list]  # what the image is made of; a change rebuilds it
    rootfs: Callable[[], tuple[Rootfs, dict]]


def _recipes() -> list[_Recipe]:
    return [
        _Recipe(PAUSE_IMAGE, "pause", lambda: [PAUSE_SOURCE.read_bytes()], pause_rootfs),
        # CoreDNS is 50 MB: its size and mtime stand for its contents.
        _Recipe(COREDNS_IMAGE, "coredns", lambda: _size_and_mtime(coredns_binary()), coredns_rootfs),
        _Recipe(PROMETHEUS_IMAGE, "prometheus", lambda: _size_and_mtime(prometheus_binary()), prometheus_rootfs),
        _Recipe(KUEUE_IMAGE, "kueue", lambda: _size_and_mtime(kueue_binary()), kueue_rootfs),
        _Recipe(TRAINER_TEST_IMAGE, "trainer-hostvenv", lambda: [str(project_venv().path)], trainer_rootfs),
    ]


def _inputs_digest(recipe: _Recipe) -> str:
    h = hashlib.sha256(recipe.ref.encode())
    h.update(Path(__file__).read_bytes())  # how the image is assembled is an input too
    h.update(Path(oci.__file__).read_bytes())

    def feed(value) -> None:
        if isinstance(value, (list, tuple)):
            h.update(b"[%d" % len(value))
            for v in value:
                feed(v)
        else:
            data = value if isinstance(value, bytes) else str(value).encode()
            h.update(b"%d:" % len(data) + data)

    feed(recipe.inputs())
    return h.hexdigest()


def build_images(only: Collection[str] | None = None) -> dict[str, Path]:
    """Build the image archives (all, or the refs in `only`) into build.cache_root()/images;
    return {ref: archive}. An archive whose inputs did not change is not rebuilt."""
    recipes = [r for r in _recipes() if only is None or r.ref in only]
    known = {r.ref for r in _recipes()} | {OPERATOR_IMAGE}
    if only is not None and set(only) - known:
        raise ValueError(f"no such image: {', '.join(sorted(set(only) - known))}")
    built: dict[str, Path] = {}
    if only is None or OPERATOR_IMAGE in only:
        built[OPERATOR_IMAGE] = Path(dockerfiles.build_image("operator")["archive"])
    for recipe in recipes:
        archive = build.cache_root() / "images" / f"{recipe.name}.oci.tar"
        stamp = archive.with_name(archive.name + ".inputs")
        digest = _inputs_digest(recipe)
        if not (archive.exists() and stamp.exists() and stamp.read_text() == digest):
            t0 = time.monotonic()
            fs, config = recipe.rootfs()
            oci.oci_archive(archive, recipe.ref, fs, config)
            stamp.write_text(digest)
            print(f"built {recipe.ref} in {time.monotonic() - t0:.1f}s: {archive} "
                  f"({archive.stat().st_size / 1e6:.1f} MB)", file=sys.stderr, flush=True)
        built[recipe.ref] = archive
    return built
