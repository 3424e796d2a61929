"""What the docs name exists. Every test a page cites (`test_...`) is a test function or a
test module in tests/, so a renamed or deleted test cannot leave a page pointing at nothing;
every other name a page gives in backticks (a path, a module, a class and its member, a CLI
flag, an environment variable, a constant, a metric, a make target: see docs_names.py for how
each is resolved) is in the code; and the pages name what a newcomer needs to know exists (every
metric, every variable of the pod contract, every `--inject` action).

To check the pages of another tree (an older commit's, say) against this code:
`python tests/unit/docs_names.py DIR` where DIR holds docs/*.md and README.md."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from docs_coverage import unnamed
from docs_names import ROOT, check, names, pages


def test_every_test_the_docs_cite_exists():
    tests = list((ROOT / "tests").rglob("test_*.py"))
    defined = {m for p in tests for m in re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(), re.MULTILINE)}
    modules = {p.stem for p in tests}
    cited = {(name, page.name) for page in pages(ROOT) for name in re.findall(r"`(test_\w+)", page.read_text())}
    assert len(cited) > 100  # the pages do cite their proof
    missing = sorted((name, page) for name, page in cited if name not in defined and name not in modules)
    assert missing == [], missing


def test_every_name_the_docs_give_exists():
    count, missing = check(ROOT)
    assert count > 700  # paths, modules, classes, flags, variables, metrics the pages name
    assert missing == [], "\n".join(missing)


def test_the_docs_name_every_metric_variable_and_fault():
    assert unnamed(ROOT) == []


def test_the_checker_finds_what_does_not_exist(tmp_path: Path):
    """Each kind of name, resolved against this repository: a wrong one is reported, a right
    one is not, and upstream names (PyTorch's, Kubernetes') are not ours to check."""
    def found(token):
        return {(kind, name) for kind, name, ok in names(token) if not ok}

    assert found("launcher/transom/ft/trainer.py") == set()
    assert found("launcher/transom/ft/no_such.py") == {("path", "launcher/transom/ft/no_such.py")}
    assert found("ft/catchup.py") == set()
    assert found("tests/unit/test_docs_names.py::test_every_name_the_docs_give_exists") == set()
    assert found("tests/unit/test_docs_names.py::nothing") == {("path", "tests/unit/test_docs_names.py::nothing")}
    assert found("transom.errors.ScriptError") == set()
    assert found("transom.errors.NoSuchError") == {("python", "transom.errors.NoSuchError")}
    assert found("transom.nothing") == {("python", "transom.nothing")}
    assert found("CheckpointConfig.from_environ()") == set()
    assert found("CheckpointConfig.from_nowhere()") == {("python", "CheckpointConfig.from_nowhere")}
    assert found("trainer.no_sync()") == set() and found("trainer.nothing") == {("python", "trainer.nothing")}
    assert found("contract.EXIT_SCRIPT_ERROR") == set()
    assert found("torch.load(FILE, weights_only=True)") == set()  # PyTorch's
    assert found("FaultTolerant") == set() and found("NoSuchThingAnywhere") == {("class", "NoSuchThingAnywhere")}
    assert found("--inject SPEC") == set() and found("--no-such-flag") == {("flag", "--no-such-flag")}
    assert found("kubectl drain NODE --no-such-flag") == set()  # kubectl's
    assert found("TRANSOM_FAULT") == set() and found("TRANSOM_NOTHING") == {("env", "TRANSOM_NOTHING")}
    assert found("transom_coordinator_verdicts_total{kind}") == set()
    assert found("transom_coordinator_nothing") == {("metric", "transom_coordinator_nothing")}
    assert found("make chaos") == set() and found("make nothing") == {("make", "nothing")}
    assert found("checkpoint.uri") == set()  # a key of the chart's values
    assert found("GET /v1/replicas/{id}?generation=G&attempt=A") == set()
    assert found("POST /v1/nothing") == {("route", "POST /v1/nothing")}

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(textwrap.dedent("""\
        See DESIGN.md and `launcher/transom/gone.py`; `ft/data.py` (`ReplicaSampler`) holds
        the sampler, and `Gone` in `ft/data.py` was never there. See "Heading" below, and
        "Elsewhere" below.

        ## Heading (a page's section)

        ```python
        `launcher/transom/in_a_python_block.py` is not read
        ```

        ```bash
        transom run --replicas 2 --no-such-flag -- python examples/gone.py --its-own-flag
        ```
        """))
    _, missing = check(tmp_path)
    assert sorted(missing) == ["a.md: `Gone` is not defined in `ft/data.py`",
                               "a.md: flag `transom run --no-such-flag` (in a code block)",
                               "a.md: page `DESIGN.md`", "a.md: path `examples/gone.py` (in a code block)",
                               "a.md: path `launcher/transom/gone.py`", 'a.md: section `a.md, "Elsewhere"`'], missing


def test_what_training_api_says_each_error_derives_from_is_true():
    """training-api.md says which `transom.errors` classes also derive from a builtin, and
    which from TransomError alone: checked against errors.py's class bases (ast, transitively)."""
    import ast

    tree = ast.parse((ROOT / "launcher/transom/errors.py").read_text())
    bases = {c.name: [b.id for b in c.bases if isinstance(b, ast.Name)]
             for c in tree.body if isinstance(c, ast.ClassDef)}

    def ancestors(name: str) -> set[str]:
        return {name} | {a for b in bases.get(name, []) for a in ancestors(b)}

    text = " ".join((ROOT / "docs/training-api.md").read_text().split())
    said = text[text.index("Every exception Transom raises on purpose"):text.index("Those to let propagate")]
    claims = 0
    for clause in re.split(r"[;()]", said):
        builtin = re.search(r"from `(\w+Error)`", clause)
        for name in re.findall(r"`(?:ft\.)?([A-Z]\w+)`", clause):
            if builtin and name != builtin[1]:
                assert builtin[1] in ancestors(name), f"{name} does not derive from {builtin[1]}"
                claims += 1
    alone = re.search(r"\. The (.*?) derive from `TransomError` alone", said)
    assert alone, "training-api.md no longer says which errors derive from TransomError alone"
    for name in re.findall(r"`(?:ft\.)?([A-Z]\w+)`", alone[1]):
        assert not ancestors(name) & {"RuntimeError", "ValueError", "LookupError", "TimeoutError"}, name
        claims += 1
    assert claims >= 12
    # and every class with a builtin among its own bases is in the list
    builtins = {"RuntimeError", "ValueError", "LookupError", "TimeoutError"}
    with_builtin = {n for n, b in bases.items() if set(b) & builtins}
    assert {n for n in with_builtin if f"`{n}`" not in said} <= {"InvalidBytes"}  # said through WireError, BlobError
