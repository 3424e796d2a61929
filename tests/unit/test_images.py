"""What the Dockerfiles rely on, read from their text (the builds themselves:
tests/integration/test_dockerfile_images.py and `make images`).

Every COPY source must be in the repository, every image must drop root, the entrypoints
must be console scripts that pyproject.toml declares, and every stage builds on `BASE`.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "images").glob("*.Dockerfile"))


def test_there_are_operator_and_trainer_images():
    assert {p.name for p in IMAGES} == {"operator.Dockerfile", "trainer.Dockerfile"}


@pytest.mark.parametrize("dockerfile", IMAGES, ids=[p.name for p in IMAGES])
def test_dockerfile_copies_existing_paths_runs_non_root_and_uses_declared_scripts(dockerfile):
    text = dockerfile.read_text()
    for line in text.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            sources = line.split()[1:-1]
            for src in sources:
                assert (ROOT / src.rstrip("/")).exists(), f"{dockerfile.name}: COPY {src} does not exist"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and not users[-1].startswith(("0", "root")), "the final stage must not run as root"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = re.findall(r'^ENTRYPOINT \["([^"]+)"', text, re.M)[-1]
    assert entry in scripts


CONSTRAINTS = ROOT / "images" / "constraints.txt"


def pins() -> dict[str, str]:
    """images/constraints.txt: canonical name -> version; every line `name==version`."""
    out: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            key = re.sub(r"[-_.]+", "-", name).lower()
            assert version and key not in out, f"constraints.txt: {line!r} is not one name==version"
            out[key] = version
    return out


@pytest.mark.parametrize("dockerfile", IMAGES, ids=[p.name for p in IMAGES])
def test_every_stage_builds_on_the_base_argument_with_the_pinned_versions(dockerfile):
    # `docker build` works unchanged (python:3.11-slim), `make images` passes its own base,
    # and pip installs the versions images/constraints.txt pins, whatever was released today.
    text = dockerfile.read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M)
    # Each stage starts from BASE or from an earlier stage (which did).
    stages: set[str] = set()
    for origin, name in re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M):
        assert origin == "${BASE}" or origin in stages, f"{dockerfile.name}: FROM {origin}"
        stages.add(name)
    assert len(re.findall(r"^FROM ", text, re.M)) == len(re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)) >= 2
    installs = re.findall(r"^RUN pip install .*", text, re.M)
    assert installs and all("-c images/constraints.txt" in line for line in installs)
    assert re.search(r"^COPY images/constraints.txt ", text, re.M)


def test_the_constraints_pin_what_the_dockerfiles_install_within_pyproject_s_bounds():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set()
    for dockerfile in IMAGES:
        for group in re.findall(r'pip install .*"\.\[([\w,-]*)\]"', dockerfile.read_text()):
            wanted.update(group.split(","))
    direct = [Requirement(r) for r in project["dependencies"]]
    direct += [Requirement(r) for extra in sorted(wanted) for r in project["optional-dependencies"][extra]]
    pinned = pins()
    for req in direct:
        version = pinned.get(re.sub(r"[-_.]+", "-", req.name).lower())
        assert version is not None, f"images/constraints.txt pins no {req.name}: run `make constraints`"
        assert req.specifier.contains(version, prereleases=True), \
            f"images/constraints.txt pins {req.name}=={version}, outside pyproject.toml's {req}: run `make constraints`"


def test_the_trainer_s_working_directory_is_the_non_root_user_s():
    # Relative outputs (`--log-dir demo-logs`, a run's summary) are written there by uid 65532.
    text = (ROOT / "images" / "trainer.Dockerfile").read_text()
    final = text[text.rindex("\nFROM "):]
    workdir = re.findall(r"^WORKDIR (\S+)", final, re.M)[-1]
    user = re.findall(r"^USER (\S+)", final, re.M)[-1]
    assert re.search(rf"^RUN chown {re.escape(user)} {re.escape(workdir)}$", final, re.M)
