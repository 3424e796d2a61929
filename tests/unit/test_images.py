"""The Dockerfiles cannot be built here (no Docker engine): check what they rely on exists.

Every COPY source must be in the repository, every image must drop root, and the
entrypoints must be console scripts that pyproject.toml declares.
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
