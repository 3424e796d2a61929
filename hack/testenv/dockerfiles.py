"""Images built from images/*.Dockerfile as written: daemonless, offline, checked as an admin checks them.

No registry is reachable from these machines, so `FROM python:3.11-slim` cannot be pulled.
The build is handed a stand-in through the Dockerfiles' `ARG BASE`: Debian bookworm's
minbase (mmdebstrap, from Debian's archive) with its CPython 3.11 as a venv rooted at
/usr/local, which puts `python` and `pip` where the slim image has them, and a pip.conf
that installs only from a wheelhouse mounted at /wheels, downloaded from the package index
at images/constraints.txt's pins. buildah builds the unchanged Dockerfile against it and
exports an OCI archive that the test kubelets' containerd imports (images.py); users build
the same files with `docker build` against the public base.

An image is rebuilt only when its inputs change (the Dockerfile, what it copies, the
constraints, the base's recipe and this file). Each build is checked (`check`) and leaves
beside its archive a JSON record: its id, size, user, build time and its package list.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from testenv import build, oci

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The names the chart (values.yaml image.repository, tag = appVersion) and examples/ use.
OPERATOR_REPOSITORY = "ghcr.io/transom-io/transom-operator"
OPERATOR_IMAGE = f"{OPERATOR_REPOSITORY}:{PROJECT['version']}"
TRAINER_IMAGE = f"ghcr.io/transom-io/transom-trainer:{PROJECT['version']}"

BASE_TAG = "localhost/transom-base:py311-bookworm"
SUITE = "bookworm"  # its CPython is 3.11, the product's Python
BASE_PACKAGES = ("ca-certificates", "python3.11", "python3.11-venv")
PIP_CONF = "[global]\nno-index = true\nfind-links = /wheels\n"
TOOLS = {"buildah": "/usr/bin/buildah", "mmdebstrap": "/usr/bin/mmdebstrap"}
IMAGE_PACKAGES = ("buildah", "mmdebstrap")  # Debian's packages that provide TOOLS
# Storage: native overlay (as root; vfs keeps a whole copy of every layer: 20+ GB for the
# trainer). Isolation: chroot (no user namespaces, no daemon).
ENV = dict(os.environ, STORAGE_DRIVER="overlay", BUILDAH_ISOLATION="chroot")
BUILD_TIMEOUT_S = 1800  # the trainer's wheels are 3 GB


@dataclass(frozen=True)
class Dockerfile:
    name: str  # "operator", "trainer"
    path: str  # relative to the checkout
    extras: str  # of its `pip install ".[extras]"`: the wheelhouse it needs
    ref: str  # the name it is built and exported as
    copies: tuple[str, ...]  # what its COPY lines read: a change rebuilds it


_SOURCES = (".dockerignore", "pyproject.toml", "README.md", "images/constraints.txt", "launcher", "operator")
DOCKERFILES = {
    "operator": Dockerfile("operator", "images/operator.Dockerfile", "operator", OPERATOR_IMAGE, _SOURCES),
    "trainer": Dockerfile("trainer", "images/trainer.Dockerfile", "train,s3", TRAINER_IMAGE, (*_SOURCES, "examples")),
}


class ImageBuildError(RuntimeError):
    """A Dockerfile did not build, or its image failed a check; the message says which step."""


def _run(cmd: list[str], timeout_s: float = 600, **kw) -> str:
    res = subprocess.run(cmd, env=ENV, text=True, capture_output=True, timeout=timeout_s, **kw)
    if res.returncode != 0:
        raise ImageBuildError(f"`{' '.join(cmd[:3])} ...` failed ({res.returncode}):\n"
                              f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return res.stdout


def tools() -> None:
    """buildah and mmdebstrap, from Debian's archive when root; else MissingTool naming the command."""
    missing = [name for name, path in TOOLS.items() if not Path(path).exists()]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise build.MissingTool(f"missing {', '.join(missing)}: `sudo apt-get install -y {' '.join(IMAGE_PACKAGES)}`")
    build.apt_install(IMAGE_PACKAGES)
    still = [name for name, path in TOOLS.items() if not Path(path).exists()]
    if still:
        raise build.MissingTool(f"apt-get did not provide {', '.join(still)}")


def _digest(*parts: bytes | Path) -> str:
    """A digest of bytes and of files (a directory: every file under it, by relative path)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, bytes):
            h.update(b"%d:" % len(p) + p)
            continue
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
        for f in files:
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _exists(ref: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", ref], env=ENV, capture_output=True).returncode == 0


def base() -> str:
    """The stand-in for python:3.11-slim, built once per recipe; its tag."""
    tag = f"{BASE_TAG}-{_digest(' '.join(BASE_PACKAGES).encode(), PIP_CONF.encode())[:8]}"
    if _exists(tag):
        return tag
    t0 = time.monotonic()
    work = build.cache_root() / "images"
    work.mkdir(parents=True, exist_ok=True)
    rootfs = work / "base-rootfs.tar"
    _run(["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
          "--customize-hook=chroot \"$1\" python3.11 -m venv /usr/local",
          f"--customize-hook=printf '{PIP_CONF}' > \"$1/etc/pip.conf\"", SUITE, str(rootfs)])
    ctr = _run(["buildah", "from", "scratch"]).strip()
    try:
        _run(["buildah", "add", ctr, str(rootfs), "/"])
        _run(["buildah", "config", "--env", "PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "--env", "LANG=C.UTF-8", "--cmd", "python3", ctr])
        _run(["buildah", "commit", "-q", ctr, tag])
    finally:
        subprocess.run(["buildah", "rm", ctr], env=ENV, capture_output=True)
        rootfs.unlink(missing_ok=True)
    print(f"base image {tag} built in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return tag


def wheelhouse(extras: str) -> Path:
    """The wheels of `.[extras]` at images/constraints.txt's pins, and the build backend's."""
    out = build.cache_root() / "images" / f"wheels-{extras.replace(',', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "-q", "-c", "images/constraints.txt", f".[{extras}]",
          "setuptools>=77", "-d", str(out), "--only-binary=:all:", "--python-version", "3.11"],
         cwd=ROOT, timeout_s=BUILD_TIMEOUT_S)
    return out


def _paths(name: str) -> tuple[Path, Path, Path]:
    """The image's OCI archive, its record (JSON) and its package list (JSON)."""
    d = build.cache_root() / "images"
    return d / f"{name}-dockerfile.oci.tar", d / f"{name}-dockerfile.json", d / f"{name}-dockerfile.packages.json"


def inputs_digest(df: Dockerfile, base_tag: str) -> str:
    return _digest(base_tag.encode(), df.ref.encode(), Path(__file__), ROOT / df.path,
                   *(ROOT / p for p in df.copies))


def build_image(name: str, dockerfile: Path | None = None) -> dict:
    """Build DOCKERFILES[name] (or `dockerfile` in its place: tests build broken ones), check
    it and export it; its record. Skipped when the inputs are those of the last build."""
    df = DOCKERFILES[name]
    tools()
    base_tag = base()
    archive, record_path, packages_path = _paths(name)
    key = inputs_digest(df, base_tag) if dockerfile is None else None
    if key is not None and archive.exists() and record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("inputs") == key:
            return dict(record, build_s=0.0, rebuilt=False)
    t0 = time.monotonic()
    wheels = wheelhouse(df.extras)
    tag = df.ref if dockerfile is None else f"localhost/transom-{name}-trial:latest"
    _run(["buildah", "bud", "--pull=never", "--layers", "--build-arg", f"BASE={base_tag}",
          "-v", f"{wheels}:/wheels:ro", "-f", str(dockerfile or ROOT / df.path), "-t", tag, str(ROOT)],
         timeout_s=BUILD_TIMEOUT_S)
    build_s = time.monotonic() - t0
    config = json.loads(_run(["buildah", "inspect", "--type", "image", tag]))["OCIv1"]["config"]
    packages, size = read_files(tag)
    record = {"image": tag, "user": config.get("User", ""), "entrypoint": config.get("Entrypoint") or [],
              "python_packages": len(packages["python"]), "debian_packages": len(packages["debian"]),
              "packages": str(packages_path), "build_s": round(build_s, 1)}
    check(name, record, packages)
    if dockerfile is not None:
        return dict(record, rebuilt=True)
    archive.unlink(missing_ok=True)
    _run(["buildah", "push", "--quiet", tag, f"oci-archive:{archive}:{tag}"], timeout_s=BUILD_TIMEOUT_S)
    manifest_digest, image_id = oci.archive_ids(archive)
    record.update(id=image_id, manifest_digest=manifest_digest, archive=str(archive),
                  archive_bytes=archive.stat().st_size, size_bytes=size, inputs=key)
    packages_path.write_text(json.dumps(packages, indent=1) + "\n")
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return dict(record, rebuilt=True)


def read_files(tag: str) -> tuple[dict[str, list[list[str]]], int]:
    """What the image holds, read from its files (nothing in it runs): the Python
    distributions in /usr/local's site-packages and the Debian packages dpkg installed; and
    its size unpacked (bytes, as `du` counts them)."""
    ctr = _run(["buildah", "from", "--pull=never", tag]).strip()
    try:
        root = Path(_run(["buildah", "mount", ctr]).strip())
        site = root / "usr" / "local" / "lib" / "python3.11" / "site-packages"
        python = sorted({(d.metadata["Name"], d.version) for d in importlib.metadata.distributions(path=[str(site)])
                         if d.metadata["Name"]})
        debian = []
        for stanza in (root / "var" / "lib" / "dpkg" / "status").read_text().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " ")
            if fields.get("Status", "").endswith(" installed"):
                debian.append((fields["Package"], fields["Version"]))
        size = int(_run(["du", "-sb", str(root)]).split()[0])
    finally:
        subprocess.run(["buildah", "umount", ctr], env=ENV, capture_output=True)
        subprocess.run(["buildah", "rm", ctr], env=ENV, capture_output=True)
    return {"python": [list(p) for p in python], "debian": [list(p) for p in sorted(debian)]}, size


def check(name: str, record: dict, packages: dict) -> None:
    """What an admin checks before a rollout: the image is not root's; its command answers
    `--help` as its own user and as a uid no passwd entry names (what containerd runs when a
    pod sets runAsUser); the operator's holds no torch; the trainer's trains through a kill."""
    user = record["user"]
    if user.split(":")[0] in ("", "0", "root"):
        raise ImageBuildError(f"{name}: runs as root (USER {user!r})")
    if name == "operator" and any(p[0].lower() == "torch" for p in packages["python"]):
        raise ImageBuildError("operator: torch is installed in the operator image")
    ctr = _run(["buildah", "from", "--pull=never", record["image"]]).strip()
    try:
        for uid in (user, "4242:4242"):
            for command in (record["entrypoint"][0], "transom-operator" if name == "operator" else "transom"):
                _run(["buildah", "run", "--user", uid, ctr, "--", command, "--help"])
        if name == "trainer":
            trainer_run(ctr, user)
    finally:
        subprocess.run(["buildah", "rm", ctr], env=ENV, capture_output=True)


def trainer_run(ctr: str, user: str) -> None:
    """`transom run` inside the image as its user: 2 replicas of examples/train_tiny_gpt.py,
    replica 1's worker SIGKILLed at step 8; the run ends once it caught up, and both
    replicas' final parameters must be bit-identical. Its logs go to a relative directory:
    the image's working directory must be its user's."""
    out = build.cache_root() / "images" / "trainer-check"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    out.chmod(0o777)  # written by the image's uid
    _run(["buildah", "run", "--user", user, "-v", f"{out}:/out", ctr, "--",
          "transom", "run", "--replicas", "2", "--quiet", "--log-dir", "check-logs", "--stats-dir", "/out/stats",
          "--summary-json", "/out/summary.json", "--inject", "kill:replica=1,step=8", "--end-on", "caught_up:1",
          "--", "python", "examples/train_tiny_gpt.py", "--steps", "400"], timeout_s=600)
    summary = json.loads((out / "summary.json").read_text())
    digests = {json.loads(p.read_text())["digest"] for p in (out / "stats").glob("final-r*-k*.json")}
    if not summary.get("end_on", {}).get("met") or summary.get("replica_restarts", 0) < 1 or len(digests) != 1:
        raise ImageBuildError(f"trainer: the run inside the image did not recover bit-identical: {summary}, "
                              f"{len(digests)} distinct final digests")
