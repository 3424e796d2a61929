"""One error family (transom/errors.py): every exception a user may catch derives from
TransomError, is defined once, and the coordinator and its client raise the same classes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from transom import errors
from transom.checkpoint import blob, restore
from transom.coordinator import client, membership, roster, server
from transom.ft import backend, wire

PACKAGE = Path(errors.__file__).parent
# Raised and caught inside one module, never seen by a user: the HTTP layer's parse error.
INTERNAL = {("coordinator/http.py", "BadRequest")}


def _exception_classes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if any(b.endswith(("Error", "Exception")) or b in {"LookupError"} for b in bases):
                names.append(node.name)
    return names


def test_no_exception_class_is_defined_outside_errors_py():
    strays = [(str(p.relative_to(PACKAGE)), name) for p in sorted(PACKAGE.rglob("*.py")) if p.name != "errors.py"
              for name in _exception_classes(p)]
    assert set(strays) == INTERNAL, strays


def test_every_class_in_errors_py_is_in_the_family():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 12
    assert all(issubclass(c, errors.TransomError) for c in classes)


def test_the_modules_raise_the_family_s_classes():
    assert client.Evicted is roster.Evicted is server.Evicted is errors.Evicted
    assert client.NotRegistered is roster.NotRegistered is errors.NotRegistered
    assert client.JobCompleted is membership.JobCompleted is errors.JobCompleted
    assert restore.NoCheckpoint is errors.NoCheckpoint and blob.BlobError is errors.BlobError
    assert backend.BackendError is errors.BackendError and wire.WireError is errors.WireError
    # the builtins older callers caught still catch them
    assert issubclass(errors.BackendError, ValueError) and issubclass(errors.NoCheckpoint, LookupError)
    assert issubclass(errors.TooManyFailedSteps, RuntimeError)


def test_coordinator_errors_carry_their_http_status():
    assert (errors.Evicted("x").status, errors.NotRegistered("x").status, errors.JobCompleted("x").status) == \
        (409, 404, 410)
    assert errors.CoordinatorError("unreachable").status is None
    assert errors.Evicted("x", 409).status == 409


def test_errors_imports_nothing_heavy():
    code = ("import sys, transom.errors; "
            "print(sorted(m for m in ('torch', 'kopf', 'kubernetes', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
