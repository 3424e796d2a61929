"""The operator image as images/operator.Dockerfile builds it (hack/testenv/dockerfiles.py).

The image the test kubelets run is the Dockerfile's, built by buildah offline: it must be
what the Dockerfile says (user, entrypoint), hold exactly its extras' dependencies and no
torch, carry the chart's name in the archive containerd imports, and run as a uid that no
passwd entry names (the e2e tests start it that way, under the chart's read-only root).
A Dockerfile that cannot build fails `make images` with the failing step, not a pass.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import dockerfiles  # noqa: E402

DOCKERFILE = ROOT / "images" / "operator.Dockerfile"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def final_stage() -> tuple[str, list[str], list[str]]:
    """The Dockerfile's USER, ENTRYPOINT and pip extras."""
    text = DOCKERFILE.read_text()
    final = text[text.rindex("\nFROM "):]
    user = re.findall(r"^USER\s+(\S+)", final, re.M)[-1]
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT\s+(.+)$", final, re.M)[-1])
    installed = re.search(r'pip install .*"\.\[(.*)\]"', text)
    assert installed, "the Dockerfile installs no extras"
    return user, entrypoint, installed.group(1).split(",")


def expected_distributions(extras: list[str]) -> set[str]:
    """What `pip install ".[extras]"` installs, from this (the project's) venv's metadata."""
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
def operator_image() -> dict:
    assert os.geteuid() == 0, "buildah builds as root here (`make testenv` installs it): run the tests as root"
    return dockerfiles.build_image("operator")  # built by `make testenv` already unless its inputs changed


def test_operator_image_is_its_dockerfiles(operator_image):
    user, entrypoint, extras = final_stage()
    assert (operator_image["user"], operator_image["entrypoint"]) == (user, entrypoint)
    packages = json.loads(Path(operator_image["packages"]).read_text())
    inside = {canonical(name) for name, _ in packages["python"]}
    # The base's venv brings pip (and setuptools with it); everything else is the extras'.
    assert inside - {"pip", "setuptools"} == expected_distributions(extras)
    assert not inside & {"torch", "numpy", "boto3"}
    pins = dict(line.split("==") for line in (ROOT / "images" / "constraints.txt").read_text().splitlines()
                if "==" in line)
    pins = {canonical(name): version for name, version in pins.items()}
    assert {canonical(n): v for n, v in packages["python"] if canonical(n) not in ("pip", "setuptools", "transom")} \
        == {name: pins[name] for name in inside - {"pip", "setuptools", "transom"}}
    assert "python3.11" in {name for name, _ in packages["debian"]}  # the base's CPython, from Debian


def test_the_archive_is_named_for_the_chart_and_ids_the_image(operator_image):
    with tarfile.open(operator_image["archive"]) as tar:
        def read(name: str) -> dict:
            f = tar.extractfile(name)
            assert f is not None
            return json.loads(f.read())

        [desc] = read("index.json")["manifests"]
        manifest = read(f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}")
        config = read(f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}")
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == dockerfiles.OPERATOR_IMAGE
    assert (operator_image["id"], operator_image["manifest_digest"]) == (manifest["config"]["digest"], desc["digest"])
    assert config["config"]["User"] == operator_image["user"]


def test_the_operator_image_runs_as_a_uid_no_passwd_entry_names(operator_image):
    """Its uid (and any other a pod may set) has no passwd entry, as in the public base."""
    uid = operator_image["user"].split(":")[0]
    ctr = dockerfiles._run(["buildah", "from", "--pull=never", operator_image["image"]]).strip()
    try:
        passwd = dockerfiles._run(["buildah", "run", ctr, "--", "cat", "/etc/passwd"])
        assert not [line for line in passwd.splitlines() if line.split(":")[2] in (uid, "4242")], passwd
        for who in (operator_image["user"], "4242:4242"):
            out = dockerfiles._run(["buildah", "run", "--user", who, ctr, "--", "python", "-c",
                                    "import os, transom_operator.main, transom.coordinator.server; print(os.getuid())"])
            assert out.strip() == who.split(":")[0]
    finally:
        subprocess.run(["buildah", "rm", ctr], env=dockerfiles.ENV, capture_output=True)


def test_a_broken_dockerfile_fails_the_build_at_its_step(tmp_path):
    broken = tmp_path / "operator.Dockerfile"
    broken.write_text(DOCKERFILE.read_text().replace('".[operator]"', '".[operator]" transom-no-such-dependency'))
    assert broken.read_text() != DOCKERFILE.read_text()
    with pytest.raises(dockerfiles.ImageBuildError) as failed:
        dockerfiles.build_image("operator", dockerfile=broken)
    assert "building at STEP" in str(failed.value) and "transom-no-such-dependency" in str(failed.value)


def test_make_images_prints_each_images_figures(operator_image):
    out = subprocess.run([sys.executable, str(ROOT / "hack" / "testenv"), "images", "operator"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    line, *_, last = out.stdout.splitlines()
    assert line.startswith(f"{dockerfiles.OPERATOR_IMAGE}: id {operator_image['id'][7:19]}, ")
    assert "user 65532:65532" in line and "inputs unchanged" in line
    record = json.loads(last)["images"]["operator"]
    assert record["size_bytes"] > record["archive_bytes"] > 10e6 and record["rebuilt"] is False
