"""The images hack/testenv/images.py writes for the test cluster's kubelets.

The OCI writer must be deterministic and self-consistent (digests and sizes that
containerd checks on import); the operator image carries the chart's name (the image
itself, built from its Dockerfile: tests/integration/test_dockerfile_images.py).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import images, oci  # noqa: E402


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
    # What the nodes' import compares and what a pod's imageID shows, read back from the archive.
    assert oci.archive_ids(first) == (image["desc"]["digest"], image["manifest"]["config"]["digest"])

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


def test_operator_image_is_the_charts_default():
    chart = yaml.safe_load((ROOT / "charts" / "transom" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "transom" / "values.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert images.OPERATOR_IMAGE == f"{values['image']['repository']}:{chart['appVersion']}"
    assert chart["appVersion"] == version


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
