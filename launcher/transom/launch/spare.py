"""A hot spare learns which replica it becomes from its pod's labels file.

A spare pod is scheduled, pulled and started before any replica fails, and its workers
run the training script up to `FaultTolerant(...)`: Python, torch, the model and the
optimizer are loaded, and they wait there (ft/replica.py `wait_for_promotion`), so that
taking over starts no process. Its environment has TRANSOM_SPARE_ID instead of
TRANSOM_REPLICA_ID and TRANSOM_REPLICA_GENERATION, because a pod's environment cannot
change after it starts. Its labels can: the operator promotes a spare by relabelling its
pods (`transom.io/replica`, `transom.io/generation`, `transom.io/spare` removed), and the
kubelet rewrites the downward-API file `<PODINFO_DIR>/labels`. The launcher and the
workers poll that file; once it names a replica, the launcher supervises as that replica
and the workers register as it (`transom run --spares N` writes the same file locally).

The file holds one `key="value"` line per label, values quoted and escaped as Go's
strconv.Quote does (the kubelet's format).
"""

from __future__ import annotations

import ast
import errno
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from transom import contract, worker_files

log = logging.getLogger("transom.launch")
MAX_LABELS_BYTES = 1 << 20  # of the podinfo labels file (a pod's labels: far less)
POLL_S = 0.05  # a read of a small local file: polling it costs nothing worth saving


@dataclass(frozen=True)
class Assignment:
    """The replica identity the operator gave this spare."""

    replica_id: int
    generation: int


def parse_labels(text: str) -> dict[str, str]:
    """The downward-API labels file as a dict; malformed lines are skipped, never fatal."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key:
            continue
        try:
            value = ast.literal_eval(raw)  # a Go-quoted string is a valid Python literal
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, str):
            out[key.strip()] = value
    return out


def assignment(labels: Mapping[str, str]) -> Assignment | None:
    """The identity in `labels`, or None while the pod is still a spare."""
    if contract.LABEL_SPARE in labels:
        return None  # the relabel removes it together with setting the replica
    try:
        return Assignment(int(labels[contract.LABEL_REPLICA]), int(labels[contract.LABEL_GENERATION]))
    except (KeyError, ValueError):
        return None


def podinfo_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get(contract.ENV_PODINFO_DIR) or contract.PODINFO_DIR)


def read_assignment(directory: Path) -> Assignment | None:
    """The identity `directory/labels` names now; None while a spare (or unreadable).
    OSError: no regular file there (not mounted yet). Read through worker_files.py: under
    `transom run` the directory is in the stats directory, which the workers can write, and
    the launcher's loop must not wait on a FIFO there; the kubelet's file is a symbolic link."""
    path = directory / "labels"
    data = worker_files.read(path, MAX_LABELS_BYTES, follow_symlinks=True)
    if data is None:
        raise FileNotFoundError(errno.ENOENT, "no regular file", str(path))
    return assignment(parse_labels(data.decode(errors="replace")))


def poll_assignment(directory: Path) -> Assignment | None:
    """`read_assignment`, None also while the file cannot be read (the volume not mounted yet:
    the workers' `wait_for_assignment` logs it)."""
    try:
        return read_assignment(directory)
    except OSError:
        return None


def wait_for_assignment(directory: Path, stopped: Callable[[], bool], poll_s: float = POLL_S) -> Assignment | None:
    """Poll `directory/labels` until it names a replica; None if `stopped()` first.

    A spare may wait for days, so there is no deadline: the wait ends with a promotion or
    with the pod's termination (SIGTERM sets `stopped`, or the launcher stops the workers).
    """
    logged_missing = False
    while not stopped():
        try:
            found = read_assignment(directory)
        except OSError as e:
            if not logged_missing:
                log.warning("spare: cannot read %s yet (%s); is the podinfo volume mounted?", directory / "labels", e)
                logged_missing = True
            found = None
        if found is not None:
            return found
        time.sleep(poll_s)
    return None


def promoted_environ(environ: Mapping[str, str], found: Assignment) -> dict[str, str]:
    """The pod environment a replica pod with this identity would have had."""
    env = {k: v for k, v in environ.items() if k != contract.ENV_SPARE_ID}
    env[contract.ENV_REPLICA_ID] = str(found.replica_id)
    env[contract.ENV_REPLICA_GENERATION] = str(found.generation)
    return env
