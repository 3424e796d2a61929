"""The images hack/testenv/images.py writes for the test cluster's kubelets.

The OCI writer must be deterministic and self-consistent (digests and sizes that
containerd checks on import); the operator image must be what images/operator.Dockerfile
describes (user, entrypoint, exactly its extras' dependencies, no torch) and must run:
its layer is unpacked and chroot'ed into as the image's user.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import images, oci  # noqa: E402

DOCKERFILE = ROOT / "images" / "operator.Dockerfile"


def read_archive(path: Path) -> dict:
    """The archive's parts, each blob checked against the digest and size that name it."""
    with tarfile.open(path) as tar:
        files = {m.name: f.read() for m in tar.getmembers() if m.isfile() and (f := tar.extractfile(m)) is not None}

    def blob(desc: dict) -> bytes:
        data = files[f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}"]
        assert desc["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert desc["size"] == len(data)
        return data

    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    [desc] = index["manifests"]
    manifest = json.loads(blob(desc))
    config = json.loads(blob(manifest["config"]))
    [layer_desc] = manifest["layers"]
    assert layer_desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    layer = blob(layer_desc)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()]
    assert len(files) == 5, sorted(files)  # oci-layout, index.json and the three blobs
    return {"index": index, "desc": desc, "manifest": manifest, "config": config, "layer": layer}


def layer_members(layer: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        return tar.getmembers()


# ------------------------------------------------------------------ the writer


def small_rootfs(tmp_path: Path) -> oci.Rootfs:
    tool = tmp_path / "tool"
    tool.write_bytes(b"#!/bin/sh\necho hi\n")
    tool.chmod(0o750)
    fs = oci.Rootfs()
    fs.file("usr/bin/tool", source=tool)
    fs.file("etc/motd", data=b"hello\n")
    fs.symlink("bin", "usr/bin")
    fs.dir("tmp", 0o1777)
    fs.dir("home/nonroot", 0o700, 65532, 65532)
    return fs


def test_oci_archive_is_deterministic_and_consistent(tmp_path):
    config = {"User": "65532", "Entrypoint": ["/usr/bin/tool"], "Env": ["A=b"], "Cmd": None}
    first = oci.oci_archive(tmp_path / "a.tar", "transom.local/x:1.2", small_rootfs(tmp_path), config)
    time.sleep(0.01)  # a different "now" must not show
    second = oci.oci_archive(tmp_path / "b.tar", "transom.local/x:1.2", small_rootfs(tmp_path), config)
    assert first.read_bytes() == second.read_bytes()

    image = read_archive(first)
    assert image["desc"]["annotations"] == {"io.containerd.image.name": "transom.local/x:1.2",
                                            "org.opencontainers.image.ref.name": "1.2"}
    assert image["desc"]["platform"] == {"architecture": "amd64", "os": "linux"}
    assert image["manifest"]["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert (image["config"]["architecture"], image["config"]["os"]) == ("amd64", "linux")
    assert image["config"]["config"] == {"User": "65532", "Entrypoint": ["/usr/bin/tool"], "Env": ["A=b"]}
    assert image["layer"][4:8] == b"\0\0\0\0"  # the gzip header's mtime

    members = {m.name: m for m in layer_members(image["layer"])}
    assert list(members) == ["bin", "etc", "etc/motd", "home", "home/nonroot", "tmp", "usr", "usr/bin",
                             "usr/bin/tool"]
    assert all(m.mtime == 0 for m in members.values())
    assert members["usr/bin/tool"].mode == 0o755 and members["etc/motd"].mode == 0o644
    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
    assert members["tmp"].mode == 0o1777
    assert (members["home/nonroot"].uid, members["home/nonroot"].mode) == (65532, 0o700)
    assert (members["usr"].uid, members["usr"].mode) == (0, 0o755)


def test_a_path_under_a_symlink_is_refused():
    fs = oci.Rootfs()
    fs.symlink("lib", "usr/lib")
    with pytest.raises(AssertionError, match="lib is a symlink"):
        fs.file("lib/libc.so.6", data=b"")


# --------------------------------------------------------- the operator image


def dockerfile_final_stage() -> tuple[str, list[str], list[str]]:
    text = DOCKERFILE.read_text()
    final = text[text.rindex("\nFROM "):]
    user = re.findall(r"^USER\s+(\S+)", final, re.M)[-1]
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT\s+(.+)$", final, re.M)[-1])
    installed = re.search(r'pip install .*"\.\[(.*)\]"', text)
    assert installed, "the Dockerfile installs no extras"
    extras = installed.group(1).split(",")
    return user, entrypoint, extras


def expected_distributions(extras: list[str]) -> set[str]:
    """What `pip install ".[extras]"` installs, from this (the project's) venv's metadata."""
    canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    found, todo = set(), [("transom", tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        if (canonical(name), wanted) in found:
            continue
        found.add((canonical(name), wanted))
        for line in importlib.metadata.distribution(name).requires or ():
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted or ("",)):
                todo.append((req.name, tuple(sorted(req.extras))))
    return {name for name, _ in found}


@pytest.fixture(scope="module")
def operator_image(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRANSOM_TESTENV_CACHE", str(cache))
        archive = images.build_images(only=[images.OPERATOR_IMAGE])[images.OPERATOR_IMAGE]
        again = images.build_images(only=[images.OPERATOR_IMAGE])[images.OPERATOR_IMAGE]
    assert again == archive
    return read_archive(archive)


def test_operator_image_is_the_charts_default():
    chart = yaml.safe_load((ROOT / "charts" / "transom" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "transom" / "values.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert images.OPERATOR_IMAGE == f"{values['image']['repository']}:{chart['appVersion']}"
    assert chart["appVersion"] == version


def test_operator_image_matches_the_dockerfile(operator_image):
    user, entrypoint, extras = dockerfile_final_stage()
    config = operator_image["config"]["config"]
    assert (config["User"], config["Entrypoint"]) == (user, entrypoint)
    assert operator_image["desc"]["annotations"]["io.containerd.image.name"] == images.OPERATOR_IMAGE

    members = layer_members(operator_image["layer"])
    site = "usr/local/lib/python3.11/site-packages/"
    dist_infos = {m.name[len(site):].split("/")[0] for m in members
                  if m.name.startswith(site) and m.name.endswith(".dist-info/METADATA")}
    inside = {re.sub(r"[-_.]+", "-", d.split("-")[0]).lower() for d in dist_infos}
    assert inside == expected_distributions(extras)
    assert {"kopf", "kubernetes", "pyyaml", "aiohttp", "pydantic", "prometheus-client"} <= inside
    names = [m.name for m in members]
    assert not [n for n in names if re.search(r"/(torch|numpy|boto3)(/|-)", n)]
    assert not [n for n in names if "__pycache__" in n]
    size = sum(m.size for m in members)
    assert size < 300e6, f"the operator image holds {size / 1e6:.0f} MB"


def test_operator_image_runs_as_its_user(operator_image, tmp_path):
    assert os.geteuid() == 0, "this test chroots into the image's root filesystem: run it as root (CI does)"
    root = tmp_path / "root"
    with tarfile.open(fileobj=io.BytesIO(operator_image["layer"])) as tar:
        tar.extractall(root, filter="fully_trusted")
    assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777
    config = operator_image["config"]["config"]
    env = dict(e.split("=", 1) for e in config["Env"])
    chroot = shutil.which("chroot", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    base = [chroot, f"--userspec={config['User']}", str(root)]
    imports = "import transom_operator.main, transom.coordinator.server, transom.cli"
    for argv in (["/usr/local/bin/python3", "-c", imports],
                 ["/usr/local/bin/transom", "coordinator", "--help"],
                 [*config["Entrypoint"], "--help"]):
        proc = subprocess.run(base + argv, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout}\n{proc.stderr}"


# ----------------------------------------------------------- the small images


def test_trainer_test_mounts_cover_the_venvs_python():
    mounts = images.trainer_test_mounts(ROOT)
    assert all(host == inside for host, inside in mounts)
    paths = [Path(host) for host, _ in mounts]
    venv = (ROOT / ".venv").resolve()
    python = (venv / "bin" / "python").resolve()
    for needed in (venv, python, ROOT.resolve(), Path("/usr/lib")):
        assert any(needed.is_relative_to(p) for p in paths), f"{needed} is not mounted: {mounts}"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (apt-get install -y gcc libc6-dev)")
def test_pause_exits_cleanly_on_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSOM_TESTENV_CACHE", str(tmp_path))
    pause = images.pause_binary()
    assert subprocess.run([pause, "-v"], capture_output=True, text=True, check=True).stdout.startswith("transom pause")
    proc = subprocess.Popen([pause], stderr=subprocess.DEVNULL)
    time.sleep(0.2)
    assert proc.poll() is None, "pause must wait for a signal"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0


def test_trainer_test_image_lays_out_examples_as_the_trainer_dockerfile_does():
    """The e2e test runs the example's command (`python examples/...`) in the test image:
    it must find the script where the published trainer image has it."""
    import e2e_demo

    text = (ROOT / "images" / "trainer.Dockerfile").read_text()
    workdir = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)[-1]
    examples_dest = re.search(r"^COPY\s+examples/\s+(\S+)", text, re.M).group(1).rstrip("/")
    _, config = images.trainer_rootfs()
    assert config["WorkingDir"] == workdir
    assert e2e_demo.IMAGE_EXAMPLES == examples_dest
