"""The other direction of docs_names.py: what the code has that the pages must name.

`unnamed(docs)` returns a line for each metric the code registers that operations.md's tables
do not give, each TRANSOM_* variable the code reads or sets that the pages do not (contract.py's
in architecture.md's "Environment"), each flag of a `transom` command, FTConfig and
CheckpointConfig field, coordinator route and --inject action the pages leave out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from docs_names import ROOT, classes, code_text, command_flags, pages, registered, routes


def unnamed(docs: Path = ROOT) -> list[str]:
    """What the code has that the pages should name and do not: every metric family it registers
    (in operations.md's tables),
    every variable of the pod contract (contract.py's TRANSOM_*), every flag of the `transom`
    commands, every field of FTConfig and CheckpointConfig, every fault action of inject.py."""
    text = "\n".join(p.read_text() for p in pages(docs))
    out = []
    ops = (docs / "docs/operations.md").read_text() if (docs / "docs/operations.md").exists() else ""
    for name in registered():  # operations.md's tables are the metrics' reference
        if not re.search(rf"`{name}(_total|_bucket)?`", ops):
            out.append(f"metric `{name}` (operations.md)")
    # every TRANSOM_* variable the code reads or sets: the pod contract in architecture.md's
    # "Environment" (all of contract.py's there), the test environment's anywhere
    arch = (docs / "docs/architecture.md").read_text() if (docs / "docs/architecture.md").exists() else ""
    environment = arch[arch.find("## Environment"):arch.find("\n## ", arch.find("## Environment") + 1)]
    contract = set(re.findall(r"[\"'](TRANSOM_[A-Z0-9_]+)[\"']", (ROOT / "launcher/transom/contract.py").read_text()))
    for name in sorted(set(re.findall(r"\b(TRANSOM_[A-Z0-9_]*[A-Z0-9])\b", code_text()))):
        if name not in (environment if name in contract else text):
            out.append(f"env `{name}`" + (" (architecture.md, \"Environment\")" if name in contract else ""))
    text_flags = re.findall(r"--[a-z][\w-]*", text)
    commands = [("run",), ("coordinator",), ("launch",), ("simulate",), ("detect", "replay"), ("checkpoint", "export"),
                ("check",)]
    for command in commands:
        for flag in sorted(command_flags(command) - {"--help"}):
            if flag.startswith("--") and flag not in text_flags:
                out.append(f"flag `transom {' '.join(command)} {flag}`")
    api = (docs / "docs/architecture.md").read_text() if (docs / "docs/architecture.md").exists() else ""
    for method, path in sorted(routes()):
        if f"`{method} {path}" not in api:
            out.append(f"route `{method} {path}` (architecture.md)")
    for cls, page in (("FTConfig", "training-api.md"), ("CheckpointConfig", "checkpoint.md")):
        fields = [n.target.id for c in classes().get(cls, []) for n in c.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        doc = (docs / "docs" / page).read_text() if (docs / "docs" / page).exists() else ""
        out += [f"{cls}.{f} ({page})" for f in fields if f"`{f}`" not in doc]
    found = re.search(r"^ACTIONS = (\(.*\))$", (ROOT / "launcher/transom/inject.py").read_text(), re.MULTILINE)
    assert found is not None, "inject.py defines ACTIONS on one line"
    actions = ast.literal_eval(found[1])
    api = (docs / "docs/training-api.md").read_text()
    for action in actions:
        if f"`{action}`" not in api and f"`{action}:" not in api:
            out.append(f"--inject action `{action}` (training-api.md)")
    return out
