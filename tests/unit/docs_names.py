"""What the docs name exists: `check(docs)` reads the markdown pages under `docs` (docs/*.md and
README.md) and returns a line for each name they give that this repository does not have.

How each kind is resolved: by reading files and parsing Python with `ast`; the one import is
transom.cli's parser (no torch) for the flags of `transom` commands.

- a file or folder path (`launcher/transom/ft/trainer.py`, `ft/catchup.py`, `hack/chaos/`,
  `tests/integration/test_fencing.py::test_x`): a file in the repository, relative to its root or
  to one of the package roots (launcher/transom, operator/transom_operator, ...); a bare `x.py`
  must be some file of that name; after `::` a name defined in that file;
- a name given with its file (`ft/data.py` (`ReplicaSampler`), `Decision` in `records.py`):
  defined in that file;
- a Python name: `transom.x.y`, `transom_operator.x`, `module.name` where `module` is one of our
  modules or packages (`ft.init`, `contract.EXIT_SCRIPT_ERROR`, `reconcile.replicas.plan`,
  `engine.skipped` for its class's instances), a class of ours and its member
  (`Membership.try_decide`, `CheckpointConfig.from_environ()`, through our base classes), and
  the two variables every page uses for our objects (`trainer.` a FaultTolerant, `ctx.` a
  ReplicaContext); a chart value or CRD field (`checkpoint.uri`) is a key of values.yaml or the CRD;
- a bare CamelCase name (`FaultTolerant`, `PodEvicted`), or the head of `Name.member` when it is
  no class of ours: a word the code uses (an identifier or a string, not a comment or docstring);
- a CLI flag: after `transom <command>`, a flag of that command's argparse parser; alone
  (`--inject`) or another program's of ours (hack/testenv.sh, a benchmark), a literal of the code;
  kubectl's, helm's, pip's and git's are not ours;
- an environment variable `TRANSOM_*` or a constant in UPPER_SNAKE_CASE: a word the code uses;
- a metric `transom_coordinator_*` / `transom_operator_*`: a metric family the code registers
  (Gauge, Counter, Histogram, ...MetricFamily), with the suffixes Prometheus adds;
- an HTTP route (`POST /v1/quorum`): a route of the coordinator's server;
- `make target`: a target of the Makefile;
- a page (`DESIGN.md`, in prose too): a file of the repository;
- a section a page points to (architecture.md, "The step guard"): a heading or bold lead there;
- in shell code blocks: the repository paths, and the flags of each `transom` command line.

`docs_coverage.unnamed(docs)` goes the other way: what the code has that the pages must name (every metric,
TRANSOM_* variable, flag of a transom command, FTConfig/CheckpointConfig field, coordinator
route and --inject action).

"The code" is the repository less tests/ and docs/: a name that only a test or a page still says
does not exist. Run `python tests/unit/docs_names.py DIR` to check the pages of another tree
(e.g. an older commit's docs/ and README.md) against this code.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ["launcher", "operator", "hack", "benchmarks", "examples", "charts", "images", "crds", ".ci"]
CODE_FILES = ["Makefile", "pyproject.toml"]
# where a path a page names may be relative to
PATH_BASES = ["", "launcher", "launcher/transom", "operator", "operator/transom_operator",
              "operator/transom_operator/reconcile", "charts/transom"]
# the variables the pages use for our objects, as in the examples
ALIASES = {"trainer": "FaultTolerant", "ctx": "ReplicaContext"}
# names of our modules that the pages also use for PyTorch's objects (model.state_dict(),
# optimizer.step(), sampler.set_step()): `x.y` with these is not read as module.name
NOT_MODULES = {"model", "optimizer", "sampler", "scaler", "loss", "torch", "os", "sys", "time", "json"}
# Names of others' that the pages use bare and our code handles without naming them:
# PyTorch's sampler, which ReplicaSampler replaces; a Kubernetes DisruptionTarget reason that
# the operator treats as any eviction not in failures.VOLUNTARY_DISRUPTIONS.
UPSTREAM_NAMES = {"DistributedSampler", "TerminationByKubelet"}
# nanoGPT's sample.py, which a page says cannot read a checkpoint directory
UPSTREAM_FILES = {"sample.py"}
EXTENSIONS = ("py", "md", "yaml", "yml", "json", "sh", "c", "toml", "png", "Dockerfile", "txt", "go", "jsonl")
TOP = {"launcher", "operator", "hack", "benchmarks", "examples", "charts", "images", "crds", "tests", "docs"}


def spans(text: str) -> list[str]:
    """The inline code spans of a markdown page (fenced blocks left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"`([^`\n]+)`", text)


@functools.cache
def repo_files() -> frozenset[str]:
    skip = {".git", ".venv", "__pycache__", ".cache", "node_modules"}
    out = set()
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if any(part in skip for part in rel.parts):
            continue
        out.add(rel.as_posix() + ("/" if p.is_dir() else ""))
    return frozenset(out)


@functools.cache
def code_text() -> str:
    parts = []
    for rel in sorted(repo_files()):
        top = rel.split("/")[0]
        if rel.endswith("/") or not (top in CODE_DIRS or rel in CODE_FILES):
            continue
        if rel.endswith((".png", ".tar", ".gz", ".whl")):
            continue
        try:
            parts.append((ROOT / rel).read_text())
        except (UnicodeDecodeError, OSError):
            pass
    return "\n".join(parts)


@functools.cache
def code_words() -> frozenset[str]:
    """The words of the code that it uses, not those it only says: in Python, its identifiers
    and the words of its string literals, docstrings and comments left out; in every other
    file (YAML, shell, the Makefile, Dockerfiles), every word."""
    words: set[str] = set()
    for rel in repo_files():
        top = rel.split("/")[0]
        if rel.endswith(("/", ".png", ".md")) or not (top in CODE_DIRS or rel in CODE_FILES):
            continue
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if not rel.endswith(".py"):
            words.update(re.findall(r"\w+", text))
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                words.add(n.id)
            elif isinstance(n, ast.Attribute):
                words.add(n.attr)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                words.add(n.name)
            elif isinstance(n, ast.alias):
                words.update(re.findall(r"\w+", n.asname or n.name))
            elif isinstance(n, (ast.arg, ast.keyword)) and n.arg:
                words.add(n.arg)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                words.update(re.findall(r"\w+", n.value))
    return frozenset(words)


class Module:
    def __init__(self, path: Path):
        self.path = path
        self.names: dict[str, ast.AST | None] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        tree = ast.parse(path.read_text())
        for node in tree.body:
            self._top(node)

    def _top(self, node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.names[node.name] = node
        elif isinstance(node, ast.ClassDef):
            self.names[node.name] = node
            self.classes[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        self.names[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                self.names[(a.asname or a.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):
            for child in [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                          *[s for h in getattr(node, "handlers", []) for s in h.body]]:
                self._top(child)


@functools.cache
def modules() -> dict[str, Module]:
    """Our Python modules by dotted name (transom.ft.trainer, transom_operator.cache, hack.chaos)."""
    out = {}
    for rel in repo_files():
        if not rel.endswith(".py") or rel.startswith(("tests/", "docs/")):
            continue
        parts = rel[:-3].split("/")
        if parts[0] in ("launcher", "operator"):
            parts = parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        try:
            out[".".join(parts)] = Module(ROOT / rel)
        except SyntaxError:
            pass
    return out


@functools.cache
def classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for m in modules().values():
        for name, node in m.classes.items():
            out.setdefault(name, []).append(node)
    return out


def members(cls: ast.ClassDef, seen=()) -> set[str]:
    """What an instance of the class has: methods, class attributes, self.x assignments, and
    the members of its bases that are our classes."""
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    out.add(t.id)
    for walked in ast.walk(cls):
        if isinstance(walked, ast.Attribute) and isinstance(walked.value, ast.Name) and walked.value.id == "self" \
                and isinstance(walked.ctx, ast.Store):
            out.add(walked.attr)
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name == "NamedTuple":
            continue
        if name and name not in seen:
            for b in classes().get(name, []):
                out |= members(b, (*seen, name))
    return out


def class_has(name: str, rest: list[str]) -> bool:
    if not rest:
        return True
    for cls in classes().get(name, []):
        if rest[0] in members(cls):
            nested = [n for n in cls.body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
            if len(rest) == 1 or (nested and class_has_node(nested[0], rest[1:])) or not nested:
                return True
    return False


def class_has_node(cls: ast.ClassDef, rest: list[str]) -> bool:
    return not rest or rest[0] in members(cls)


def module_has(dotted: str, rest: list[str]) -> bool:
    """`rest` resolves in module `dotted`: a submodule, a top-level name, then a class member."""
    if not rest:
        return True
    sub = f"{dotted}.{rest[0]}"
    if sub in modules() and module_has(sub, rest[1:]):
        return True
    m = modules()[dotted]
    if rest[0] not in m.names:
        # `engine.skipped`: a member of the module's object, an instance of a class it defines
        return len(rest) == 1 and any(rest[0] in members(c) for c in m.classes.values())
    if len(rest) == 1:
        return True
    node = m.names[rest[0]]
    if isinstance(node, ast.ClassDef):
        return class_has_node(node, rest[1:]) or class_has(rest[0], rest[1:])
    if node is None and rest[0] in classes():  # imported or re-exported class
        return class_has(rest[0], rest[1:])
    return True  # a function or variable: what it returns is not followed


def python_name(parts: list[str]) -> bool | None:
    """True/False where the dotted name is ours to check, None where it is not (torch.load)."""
    head = parts[0]
    if head in ("transom", "transom_operator"):
        for i in range(len(parts), 0, -1):
            dotted = ".".join(parts[:i])
            if dotted in modules():
                return module_has(dotted, parts[i:])
        return False
    if head in ALIASES:
        return class_has(ALIASES[head], parts[1:2])
    if head[0].isupper():
        if head in classes():
            return class_has(head, parts[1:2])
        # not a class of ours: a name the code uses (ProcessGroupNCCL.Options), or gone
        return None if head.isupper() else head in code_words()
    if head in NOT_MODULES:
        return None
    candidates = [d for d in modules() if d == head or d.endswith("." + head)]
    if not candidates:
        return None
    return any(module_has(d, parts[1:]) for d in candidates)


@functools.cache
def config_keys() -> frozenset[str]:
    """Key paths of the chart's values and of the CRD's schema (checkpoint.uri, spec.detection)."""
    import yaml

    out = set()

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                key = [*prefix, str(k)]
                out.add(".".join(p for p in key if p not in ("properties", "items", "openAPIV3Schema")))
                walk(v, key)
        elif isinstance(node, list):
            for v in node:
                walk(v, prefix)

    walk(yaml.safe_load((ROOT / "charts/transom/values.yaml").read_text()), [])
    crd = yaml.safe_load((ROOT / "crds/trainingjobs.transom.io.yaml").read_text())
    for version in crd["spec"]["versions"]:
        walk(version["schema"], [])
    keys = set(out)
    for k in out:  # spec.checkpoint.uri is also checkpoint.uri
        if k.startswith(("spec.", "status.")):
            keys.add(k.split(".", 1)[1])
    return frozenset(keys)


@functools.cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


@functools.cache
def registered() -> tuple[str, ...]:
    """The metric families the code registers: Gauge("transom_operator_jobs", ...),
    CounterMetricFamily("transom_coordinator_verdicts", ...)."""
    pattern = r"\b(?:Gauge|Counter|Histogram|Summary|Info)\w*\(\s*[\"'](transom_(?:coordinator|operator)_\w+)[\"']"
    return tuple(sorted(set(re.findall(pattern, code_text()))))


@functools.cache
def metrics() -> frozenset[str]:
    """The metric families the code registers, with the suffixes Prometheus adds."""
    names = set(registered())
    return frozenset(names | {n + s for n in names for s in ("_total", "_bucket", "_count", "_sum", "_created")})


@functools.cache
def routes() -> frozenset[tuple[str, str]]:
    """The coordinator's HTTP routes: ("POST", "/v1/quorum"), ("GET", "/v1/replicas/{id}"), as
    its modules add them (server.py, lookups.py, owner.py)."""
    text = "".join(path.read_text() for path in sorted((ROOT / "launcher/transom/coordinator").glob("*.py")))
    return frozenset((m.upper(), path) for m, path in re.findall(r"\badd_(get|post|put)\(\s*\"([^\"]+)\"", text))


def route_exists(method: str, path: str) -> bool:
    path = path.split("?")[0]
    return any(m == method and re.fullmatch(re.sub(r"\\{\w+\\}", r"[^/]+", re.escape(p)), path) or
               m == method and p == path for m, p in routes())


def transom_command(token: str) -> tuple[str, ...] | None:
    """`transom detect replay FILE --json` -> ("detect", "replay"); None for anything else."""
    m = re.match(r"^transom ((?:[a-z]+ ?)+)", token)
    if not m:
        return None
    words = m.group(1).split()
    choices = subcommands(())
    path: list[str] = []
    for w in words:
        if w not in choices:
            break
        path.append(w)
        choices = subcommands(tuple(path))
    return tuple(path) if path else None


def _parser(path: tuple[str, ...]):
    """The argparse parser of `transom <path>`, built by transom.cli.parser() (no torch)."""
    import argparse
    import sys

    sys.path[:0] = [p for p in (str(ROOT / "launcher"),) if p not in sys.path]
    from transom.cli import parser

    p = parser()
    for word in path:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return p


@functools.cache
def subcommands(path: tuple[str, ...]) -> frozenset[str]:
    import argparse

    return frozenset(w for a in _parser(path)._actions if isinstance(a, argparse._SubParsersAction) for w in a.choices)


@functools.cache
def command_flags(path: tuple[str, ...]) -> frozenset[str]:
    return frozenset(o for a in _parser(path)._actions for o in a.option_strings)


@functools.cache
def every_command_flag() -> frozenset[str]:
    """The flags of every `transom` command (some are derived from settings models, so the
    source has no literal of them: flags.py)."""
    found: set[str] = set()
    paths: list[tuple[str, ...]] = [()]
    while paths:
        path = paths.pop()
        found |= command_flags(path)
        paths += [(*path, word) for word in subcommands(path)]
    return frozenset(found)


def path_exists(path: str) -> bool:
    files = repo_files()
    if "/" not in path.rstrip("/"):
        return any(f == path or f.endswith("/" + path) for f in files)
    return any((f"{base}/{path}" if base else path) in files for base in PATH_BASES)


def files_named(path: str) -> list[str]:
    """The repository's files a page's path may mean: under a base, or, bare, of that name."""
    if "/" not in path:
        return sorted(f for f in repo_files() if f == path or f.endswith("/" + path))
    return [rel for base in PATH_BASES for rel in [f"{base}/{path}" if base else path] if rel in repo_files()]


def defined_in_file(path: str, name: str) -> bool:
    for rel in files_named(path):
        text = (ROOT / rel).read_text()
        head, *rest = name.split(".")
        defined = rf"^\s*(?:async def|def|class) {re.escape(head)}\b|^{re.escape(head)}\b\s*[:=]"
        if re.search(defined, text, re.MULTILINE) and (not rest or rest[0] in re.findall(r"\w+", text)):
            return True
    return False


PATH = re.compile(rf"(?<![\w.~/$<-])((?:[\w.-]+/)*[\w.-]+(?:\.(?:{'|'.join(EXTENSIONS)})|/))(?:::([\w.]+))?(?![\w/<-])")
DOTTED = re.compile(r"(?<![\w./$<:-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/<-])")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
UPPER = re.compile(r"(?<![\w$])\$?([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)(?![\w])")
METRIC = re.compile(r"(?<![\w])(transom_(?:coordinator|operator)_\w+)")


def names(token: str) -> list[tuple[str, str, bool]]:
    """(kind, name, exists) for each checkable name in one code span."""
    out = []
    for m in PATH.finditer(token):
        path, member = m.group(1), m.group(2)
        if path.startswith(".") and not path.startswith((".ci/", ".venv/")) or path.startswith(".venv/"):
            continue
        if path.endswith("/") and path.split("/")[0] not in TOP | {"ft", "checkpoint", "coordinator", "detect",
                                                                  "launch", "simulate", "reconcile", "transom"}:
            continue
        if "/" not in path.rstrip("/") and not path.endswith(".py") or path in UPSTREAM_FILES:
            continue  # ckpt.pt, state.json: a file the code writes, not one of the repository's
        ok = path_exists(path) and (member is None or defined_in_file(path, member))
        out.append(("path", path + (f"::{member}" if member else ""), ok))
    if "/" not in token:
        for m in DOTTED.finditer(token):
            parts = m.group(1).split(".")
            if any(p in EXTENSIONS for p in parts[1:]) or parts[0] in ("transom",) and parts[1] == "io":
                continue  # a file name; transom.io, the API group
            ours = python_name(parts)
            if ours is None:
                continue
            # checkpoint.uri, detection.enabled: a key of the chart or the CRD
            out.append(("python", m.group(1), ours or ".".join(parts) in config_keys()))
    if CAMEL.match(token) and token not in UPSTREAM_NAMES:
        out.append(("class", token, token in code_words()))
    upstream = re.match(r"^(helm|kubectl|go|pip|git|docker|ctr)\b", token)  # their flags are not ours
    command = transom_command(token)
    for m in FLAG.finditer("" if upstream else token):
        flag = m.group(1)
        if flag == "--help":  # argparse's own
            continue
        if command is not None:  # `transom run --spares`: a flag of that very command
            out.append(("flag", f"transom {' '.join(command)} {flag}", flag in command_flags(command)))
        else:  # a flag alone, or another program's of ours (hack/testenv.sh, a benchmark)
            out.append(("flag", flag, flag in every_command_flag()
                        or re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", code_text()) is not None))
    for m in UPPER.finditer(token):
        out.append(("env" if m.group(1).startswith("TRANSOM_") else "constant", m.group(1),
                    m.group(1) in code_words()))
    for m in METRIC.finditer(token):
        out.append(("metric", m.group(1), m.group(1) in metrics()))
    route = re.match(r"^(GET|POST|PUT) (/v1/\S*|/metrics|/healthz)$", token)
    if route:
        out.append(("route", f"{route[1]} {route[2]}", route_exists(route[1], route[2])))
    mk = re.match(r"^make ([\w-]+)", token)
    if mk:
        out.append(("make", mk.group(1), mk.group(1) in make_targets()))
    return out


def sections(docs: Path, page: str) -> Titles:
    """The headings and bold paragraph leads of a page (README.md or docs/<page>)."""
    path = docs / page if page == "README.md" else docs / "docs" / page
    if not path.exists():
        return Titles([])
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    titles = [t.strip().strip("`") for t in re.findall(r"^#+ (.+)$", text, re.MULTILINE)]
    titles += [t.strip().rstrip(".:").strip("`") for t in re.findall(r"\*\*([^*\n]+)\*\*", text)]
    return Titles(titles)


class Titles(list):
    """`title in titles`: a heading that is the title or begins with it ("Catching up" for
    "Catching up without stopping anyone"), whatever follows in parentheses."""

    def __contains__(self, title: object) -> bool:
        return any(t == title or t.startswith(f"{title} ") for t in self)


def pages(docs: Path) -> list[Path]:
    """docs/*.md and README.md under a root laid out as the repository is."""
    return [*sorted((docs / "docs").glob("*.md")), *([docs / "README.md"] if (docs / "README.md").exists() else [])]


def check(docs: Path = ROOT) -> tuple[int, list[str]]:
    """(how many names the pages under `docs` name, one line per name that does not exist)."""
    seen, missing = set(), []
    for page in pages(docs):
        text = page.read_text()
        # a page that sends the reader to another page (DESIGN.md, [x](y.md)): it is in the repository
        for doc in set(re.findall(r"(?<![\w/.-])([\w/.-]*[A-Za-z]\.md)\b", text)):
            seen.add((page.name, "page", doc))
            if not (path_exists(doc) or (page.parent / doc).exists()):
                missing.append(f"{page.name}: page `{doc}`")
        # `ft/data.py` (`ReplicaSampler`), `Decision` in `records.py`: the name is defined there
        pairs = [(m[1], m[0]) for m in re.findall(r"`([\w/.-]+\.py)` \(`([A-Za-z_]\w*)`", text)]
        pairs += re.findall(r"`([A-Za-z_]\w*)` (?:\(|in )`([\w/.-]+\.py)`", text)
        for name, path in set(pairs):
            seen.add((page.name, "defined in", f"{path}::{name}"))
            if Path(path).stem != name and not defined_in_file(path, name):
                missing.append(f"{page.name}: `{name}` is not defined in `{path}`")
        # a section a page points to (architecture.md, "The step guard"; "Known limits" below):
        # a heading, or a paragraph's bold lead, of that page
        refs = [(m[0], m[1]) for m in re.findall(r"([\w-]+\.md),? \"([^\"\n]{3,80})\"", text)]
        refs += [(page.name, m) for m in re.findall(r"(?:section|see|in) \"([A-Z][^\"\n]{3,80})\"", text)]
        refs += [(page.name, m) for m in re.findall(r"\"([A-Z][^\"\n]{3,80})\",? (?:below|above)", text)]
        for target, title in set(refs):
            seen.add((page.name, "section", f"{target}: {title}"))
            if title not in sections(docs, target):
                missing.append(f"{page.name}: section `{target}, \"{title}\"`")
        # shell blocks: the repository's paths they use, and the flags of a `transom` command line
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            if lang not in ("bash", "sh", ""):
                continue
            for m in PATH.finditer(body):
                path = m.group(1)
                if "/" in path.rstrip("/") and not path.startswith((".venv/", ".")) and path.split("/")[0] in TOP:
                    seen.add((page.name, "path", path))
                    if not path_exists(path):
                        missing.append(f"{page.name}: path `{path}` (in a code block)")
            for line in re.findall(r"^\s*(?:\.venv/bin/)?(transom [^\n]*)", body, re.MULTILINE):
                command = transom_command(line)
                if command is None:
                    continue
                for flag in FLAG.findall(line.split(" -- ")[0]):
                    seen.add((page.name, "flag", f"transom {' '.join(command)} {flag}"))
                    if flag != "--help" and flag not in command_flags(command):
                        missing.append(f"{page.name}: flag `transom {' '.join(command)} {flag}` (in a code block)")
        for token in spans(text):
            for kind, name, ok in names(token):
                if (page.name, kind, name) in seen:
                    continue
                seen.add((page.name, kind, name))
                if not ok:
                    missing.append(f"{page.name}: {kind} `{name}`")
    return len(seen), missing


if __name__ == "__main__":  # python tests/unit/docs_names.py [ROOT]: check the pages of another tree
    import sys

    args = [a for a in sys.argv[1:] if a != "-v"]
    count, missing = check(Path(args[0]) if args else ROOT)
    print(f"{count} names, {len(missing)} missing")
    if "-v" in sys.argv:
        for page in pages(ROOT):
            for token in spans(page.read_text()):
                for kind, name, ok in names(token):
                    print("CHECKED", kind, name, ok)
    print("\n".join(missing))
    from docs_coverage import unnamed

    print("unnamed:", *unnamed(Path(args[0]) if args else ROOT), sep="\n")
