"""Container images for the test cluster's real kubelets, built offline as OCI archives.

There is no registry and no Docker engine here, so each image is one deterministic layer
in an OCI image-layout tar (oci.py) that containerd 1.6 imports with
`ctr -n k8s.io images import ARCHIVE`.

- `PAUSE_IMAGE`: the sandbox image, a static C `pause` compiled from pause.c;
  `COREDNS_IMAGE`, `PROMETHEUS_IMAGE`, `KUEUE_IMAGE`: the static binaries build.py builds.
- `OPERATOR_IMAGE` (the coordinator's too): images/operator.Dockerfile's image assembled
  from the host: its CPython with the shared libraries `ldd` names, the project's packages
  and the closure of the Dockerfile's extras copied from the project venv by their RECORDs.
  User, entrypoint and extras are read from the Dockerfile so that the two agree.
- `TRAINER_TEST_IMAGE` (tests only): an empty merged-/usr root meant to run the project
  venv from the host through the hostPath mounts `trainer_test_mounts` lists (torch is
  several GB; copying it into an image would gain nothing on a one-machine cluster).

`build_images()` writes them to `build.cache_root()/images` and rebuilds an archive only
when a hash of its inputs changed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from testenv import build, oci
from testenv.oci import Rootfs

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "operator.Dockerfile"
PAUSE_SOURCE = Path(__file__).resolve().parent / "pause.c"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

PAUSE_IMAGE = "transom.local/pause:3.10"
COREDNS_IMAGE = f"transom.local/coredns:{build.COREDNS_VERSION}"
PROMETHEUS_IMAGE = f"transom.local/prometheus:{build.PROMETHEUS_VERSION}"
KUEUE_IMAGE = f"transom.local/kueue:{build.KUEUE_VERSION}"
# The chart's default image (values.yaml image.repository, tag = appVersion = this version).
OPERATOR_REPOSITORY = "ghcr.io/transom-io/transom-operator"
OPERATOR_IMAGE = f"{OPERATOR_REPOSITORY}:{PROJECT['version']}"
TRAINER_TEST_IMAGE = "transom.local/trainer-hostvenv:test"

NONROOT = 65532  # distroless's "nonroot", the user the Dockerfiles run as
PAUSE_USER = 65535  # the upstream pause image's user
MULTIARCH = "x86_64-linux-gnu"  # the images are linux/amd64 only
# Stdlib directories no server needs: the test suites, IDLE, Tk and pip's bootstrap (and
# config-3.x-*, whose static libpython is 44 MB: no extension is ever built in the image).
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "ensurepip",
                    "__pycache__", "site-packages"}
DYNLOAD_SKIP = re.compile(r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|_tkinter)")


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
class DockerfileImage:
    """What images/operator.Dockerfile decides about its image."""
    user: str  # the final stage's USER
    entrypoint: list[str]  # the final stage's ENTRYPOINT
    extras: list[str]  # the extras of its `pip install ".[...]"`
    python: str  # the X.Y of its default base image, python:X.Y-slim


def read_dockerfile(path: Path = DOCKERFILE) -> DockerfileImage:
    text = path.read_text()
    final = text[text.rindex("\nFROM "):]
    user = re.findall(r"^USER\s+(\S+)", final, re.M)
    entry = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", final, re.M)
    extras = re.search(r'^RUN .*pip install .*"\.\[([\w,-]*)\]"', text, re.M)
    python = re.search(r"^ARG BASE=python:(\d+\.\d+)", text, re.M)  # the default base: python:X.Y-slim
    if not (user and entry and extras and python):
        raise ValueError(f"{path}: expected USER, ENTRYPOINT [..], ARG BASE=python:X.Y and pip install \".[extras]\"")
    return DockerfileImage(user[-1], json.loads(entry[-1]), extras.group(1).split(","), python.group(1))


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


# ----------------------------------------------------------------- the operator image


def _ldd(paths: list[Path]) -> tuple[set[str], set[str]]:
    """The libraries the loader would map for `paths`, and the names it cannot find."""
    # ldd exits 1 when one of many files is not dynamic: read its output regardless.
    out = subprocess.run(["ldd", *map(str, paths)], capture_output=True, text=True).stdout
    found = set(re.findall(r"^\t(?:\S+ => )?(/\S+) \(0x", out, re.M))
    return found, set(re.findall(r"^\t(\S+) => not found", out, re.M))


def _add_python(fs: Rootfs, venv: Venv) -> list[Path]:
    """The host's CPython as /usr/local's; return its binaries for _add_libraries."""
    py, base = f"python{venv.python}", venv.base_prefix
    fs.file(f"usr/local/bin/{py}", source=base / "bin" / py)
    fs.symlink("usr/local/bin/python3", py)
    fs.symlink("usr/local/bin/python", "python3")
    stdlib = base / "lib" / py

    def skip(p: Path) -> bool:
        if p.parent.name == "lib-dynload":
            return bool(DYNLOAD_SKIP.match(p.name))
        return p.name in STDLIB_SKIP_DIRS or p.name.startswith("config-") or p.suffix == ".pyc"

    fs.tree(stdlib, f"usr/local/lib/{py}", skip)
    fs.dir(f"usr/local/lib/{py}/site-packages")
    return [base / "bin" / py, *(p for p in sorted((stdlib / "lib-dynload").glob("*.so")) if not skip(p))]


def _add_libraries(fs: Rootfs, binaries: list[Path], venv: Venv) -> list[str]:
    """Every shared library `binaries` load, at its host path; return their paths."""
    libs, missing = _ldd(binaries)
    if missing:
        print(f"warning: ldd finds no {', '.join(sorted(missing))} (a module using it will not import)",
              file=sys.stderr)
    copied = []
    for lib in sorted(libs):
        if Path(lib).is_relative_to(venv.site_packages):
            continue  # a wheel's bundled library (pkg.libs/), copied with its distribution
        if Path(lib).is_relative_to(venv.base_prefix):
            # libpython: the binary's RUNPATH is the host prefix, absent in the image, so it
            # goes where the loader looks without one (there is no ld.so.cache either).
            fs.file(f"usr/lib/{MULTIARCH}/{Path(lib).name}", source=Path(os.path.realpath(lib)))
        else:
            fs.host_file(lib)
        copied.append(lib)
    return copied


def _add_distributions(fs: Rootfs, dists: Iterable[importlib.metadata.Distribution], site: Path,
                       target: str) -> list[Path]:
    """Copy each distribution's files (RECORD) from `site`; return its extension modules."""
    extensions = []
    for dist in dists:
        if dist.files is None:
            raise ValueError(f"{dist.metadata['Name']} has no RECORD in {site}; reinstall it with pip")
        for rel in dist.files:
            parts = PurePosixPath(str(rel)).parts
            if parts[0] == ".." or "__pycache__" in parts:
                continue  # console scripts outside site-packages, bytecode (never read: see Env)
            src = site / str(rel)
            if src.is_file():
                fs.file(f"{target}/{rel}", source=src)
                if ".so" in src.suffixes:
                    extensions.append(src)
    return extensions


def _add_project(fs: Rootfs, target: str, venv: Venv) -> None:
    """The transom packages from the checkout, their dist-info, and the console scripts."""
    for pkg in (ROOT / "launcher" / "transom", ROOT / "operator" / "transom_operator"):
        fs.tree(pkg, f"{target}/{pkg.name}", lambda p: p.name == "__pycache__" or p.suffix == ".pyc")
    dist = installed_distributions(venv.site_packages).get("transom")
    if dist is None:
        raise build.MissingTool(f"transom is not installed in {venv.path}: run `make install`")
    info = f"{target}/transom-{PROJECT['version']}.dist-info"
    for name in ("METADATA", "entry_points.txt"):
        fs.file(f"{info}/{name}", data=(dist.read_text(name) or "").encode())
    fs.file(f"{info}/INSTALLER", data=b"transom-testenv\n")
    for script, spec in sorted(PROJECT["scripts"].items()):
        module, _, attr = spec.partition(":")
        fs.file(f"usr/local/bin/{script}", mode=0o755, data=(
            "#!/usr/local/bin/python3\nimport sys\n"
            f"from {module} import {attr.split('.')[0]}\n"
            f"if __name__ == '__main__':\n    sys.exit({attr}())\n").encode())


def operator_rootfs() -> tuple[Rootfs, dict]:
    docker, venv = read_dockerfile(), project_venv()
    here = "{}.{}".format(*sys.version_info)  # dependency_closure evaluates markers for this one
    if not docker.python == venv.python == here:
        raise ValueError(f"{DOCKERFILE.name} is based on python:{docker.python}, the venv has {venv.python} "
                         f"and this is {here}: run hack/testenv.sh (the venv's python)")
    fs = Rootfs()
    merged_usr(fs)
    users(fs)
    target = f"usr/local/lib/python{venv.python}/site-packages"
    binaries = _add_python(fs, venv)
    dists = dependency_closure(docker.extras, venv.site_packages)
    binaries += _add_distributions(fs, dists.values(), venv.site_packages, target)
    _add_project(fs, target, venv)
    libs = _add_libraries(fs, binaries, venv)
    print(f"{OPERATOR_IMAGE}: {len(dists)} distributions ({', '.join(dists)}); "
          f"{len(libs)} host libraries", file=sys.stderr)
    config = {"User": docker.user, "Entrypoint": docker.entrypoint,
              # PYTHONDONTWRITEBYTECODE: the coordinator's root filesystem is read-only.
              "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE=1"]}
    return fs, config


def _operator_inputs() -> list:
    venv = project_venv()
    sources = sorted(p for pkg in ("launcher/transom", "operator/transom_operator")
                     for p in (ROOT / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    dists = installed_distributions(venv.site_packages)
    return [DOCKERFILE.read_bytes(), (ROOT / "pyproject.toml").read_bytes(), str(venv.base_prefix),
            [(str(p.relative_to(ROOT)), p.read_bytes()) for p in sources],
            sorted((n, d.version) for n, d in dists.items())]


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
        _Recipe(OPERATOR_IMAGE, "operator", _operator_inputs, operator_rootfs),
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
    if only is not None and set(only) - {r.ref for r in recipes}:
        raise ValueError(f"no such image: {', '.join(sorted(set(only) - {r.ref for r in recipes}))}")
    built: dict[str, Path] = {}
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
