"""One source per name and bound: every TRANSOM_* environment variable the product reads or
sets is spelled once, in transom/contract.py, and the bounds that `transom run` and the CRD
share are the same numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = (ROOT / "launcher" / "transom", ROOT / "operator" / "transom_operator")
CONTRACT = ROOT / "launcher" / "transom" / "contract.py"
ENV_NAME = re.compile(r"TRANSOM_[A-Z0-9_]+")


def env_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in `path` that is a TRANSOM_* name, alone or at
    the start of an f-string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value):
            found.append((node.lineno, node.value))
    return found


def test_every_transom_variable_is_named_in_contract_py_only():
    outside = [f"{p.relative_to(ROOT)}:{line}: {text}"
               for d in PRODUCT for p in sorted(d.rglob("*.py")) if p != CONTRACT
               for line, text in env_literals(p)]
    assert outside == [], "name these in transom/contract.py and import them:\n" + "\n".join(outside)


def test_the_finder_sees_a_literal_name(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nos.environ.get("TRANSOM_SOMETHING")\nx = "TRANSOM_ is a prefix"\n')
    assert env_literals(probe) == [(2, "TRANSOM_SOMETHING")]


def test_transom_run_refuses_what_the_crd_refuses():
    from transom import contract
    from transom.launch.config import RunConfig
    from transom_operator.api import Checkpoint, FaultTolerance

    crd, run = FaultTolerance.model_fields, RunConfig.model_fields
    for name in ("heartbeat_timeout", "collective_timeout"):
        assert _le(crd[f"{name}_seconds"]) == contract.MAX_WAIT_SECONDS == _le(run[f"{name}_s"])
    assert _le(crd["max_replica_restarts"]) == contract.MAX_REPLICA_RESTARTS == _le(run["max_restarts"])
    checkpoint = Checkpoint.model_fields
    assert _le(checkpoint["interval_steps"]) == contract.MAX_INTERVAL_STEPS == _le(run["checkpoint_interval"])
    assert _le(checkpoint["keep"]) == contract.MAX_KEEP == _le(run["checkpoint_keep"])


def _le(field) -> int:  # noqa: ANN001 (a pydantic FieldInfo)
    return next(m.le for m in field.metadata if getattr(m, "le", None) is not None)


def public_classes(package: Path) -> dict[str, list[str]]:
    """Each public top-level class name of `package` and the modules that define it."""
    names: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return names


def test_no_two_classes_of_a_package_share_a_name():
    """A reader who meets `Manifest` or `ReplicaState` should not have to ask which one. (The
    operator's status models mirror some of the coordinator's names on purpose: they are the
    API's spelling of the same things, in another package.)"""
    for package in PRODUCT:
        twice = {name: where for name, where in public_classes(package).items() if len(where) > 1}
        assert twice == {}, f"classes defined twice in {package.name}: {twice}"


def test_the_crds_detection_actions_are_the_detectors_words():
    from typing import get_args

    from transom.words import DetectAction
    from transom_operator.api import Detection

    fields = Detection.model_fields
    assert set(get_args(fields["slow_action"].annotation)) == set(DetectAction)
    assert set(get_args(fields["action"].annotation)) == set(DetectAction) - {DetectAction.REBALANCE}


SETTINGS_CLASSES = {  # the settings a user gives (flags, spec fields, constructor arguments)
    "launcher/transom/ft/config.py": ("FTConfig",),
    "launcher/transom/checkpoint/engine.py": ("CheckpointConfig",),
    "launcher/transom/launch/config.py": ("LaunchConfig", "RunConfig"),
}


def literal_second_defaults(path: Path, classes: tuple[str, ...]) -> list[str]:
    """`Class.field` of each `*_s` field of `classes` whose default is a number written in place
    (0, "off", excepted) rather than a name from defaults.py."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for item in node.body:
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and item.target.id.endswith("_s") and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, (int, float)) and item.value.value != 0):
                found.append(f"{node.name}.{item.target.id}")
    return found


def test_every_wait_a_user_can_set_defaults_to_a_value_of_defaults_py():
    literal = [f"{rel}: {name}" for rel, classes in SETTINGS_CLASSES.items()
               for name in literal_second_defaults(ROOT / rel, classes)]
    assert literal == [], "give these their default in transom/defaults.py:\n" + "\n".join(literal)


def test_a_wait_written_in_place_is_seen(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("class C:\n    a_s: float = 3.0\n    b_s: float = 0\n    c: int = 5\n    d_s: float = X\n")
    assert literal_second_defaults(probe, ("C",)) == ["C.a_s"]
