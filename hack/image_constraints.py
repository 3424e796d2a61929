"""Write images/constraints.txt: every distribution the images' `pip install ".[extras]"`
brings, pinned to one version, so that building an image resolves the same set on any day
and with the pip its base brings. Unpinned, pip 24.0 (what Python 3.11's installer bundles)
gave up with ResolutionImpossible: boto3's newest wanted a botocore that s3fs's newest
aiobotocore refuses, and a release of any of them can move that again.

The versions are the project venv's, which a current pip resolved (`make install`) for
this Python on linux/amd64, the images' platform. Run `make constraints` after changing a
dependency in pyproject.toml; tests/unit/test_images.py checks that the pins cover what
the Dockerfiles' extras name and satisfy pyproject.toml.

    .venv/bin/python hack/image_constraints.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from testenv import images  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "images" / "constraints.txt"
HEADER = """\
# The versions the images install (`pip install -c images/constraints.txt ...`), one per
# distribution: written by `make constraints` (hack/image_constraints.py) from the project
# venv. Do not edit by hand; change pyproject.toml and run `make constraints`.
"""


def dockerfile_extras() -> list[str]:
    """The extras every Dockerfile of images/ installs, together."""
    found: set[str] = set()
    for path in sorted((ROOT / "images").glob("*.Dockerfile")):
        for group in re.findall(r'pip install .*"\.\[([\w,-]*)\]"', path.read_text()):
            found.update(group.split(","))
    return sorted(found)


def main() -> int:
    venv = images.project_venv()
    closure = images.dependency_closure(dockerfile_extras(), venv.site_packages)
    lines = [f"{dist.metadata['Name']}=={dist.version}" for dist in closure.values()]
    OUT.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(lines)} distributions for extras {dockerfile_extras()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
