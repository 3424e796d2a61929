"""What the watches last showed: each job, its pods and every node, so a reconcile pass reads
memory instead of asking the API server for thousands of pods and a job of tens of
kilobytes on every event.

The kopf event handlers (handlers.py) feed every TrainingJob event, every pod event of a
job's pods and every node event in; a pass reads the job, its pods and the nodes from here
(controller.py). A job's pods are listed from the API once when its first pass needs them,
and again when their list is older than `resync_s` (a watch that dropped a DELETED event
while it reconnected cannot leave a ghost for longer than that). Between lists, an object
is replaced only by a newer resourceVersion, so a late event never rolls the view back.

The job itself is read from the API (GET) on its first pass and every `resync_s`; between,
the watch's events and the responses to the operator's own status writes keep it current,
newest resourceVersion first. So a pass never works from a status older than the operator's
own last write, which its JSON patch is computed against (a write that fails anyway drops the
cached job: the next pass reads it again). A deleted job leaves a tombstone, so the response
of a write that raced the deletion cannot bring it back.

A pass may run before the events of its own writes arrive: it then sees a pod it created
as missing, or one it deleted as present. The writes are idempotent (deterministic names:
409 on create is "exists", 404 on delete is "gone"), and a pod missing from a replica
counts as lost only once the status recorded the replica Running with it, so such a pass
repeats a write at most. A deleted pod's last state stays readable for `DEPARTED_S`
(`departed`): a pass that finds a pod gone learns from it why. Thread-safe: events arrive on
kopf's loop, passes run in threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transom import contract

RESYNC_S = 60.0
# How long a deleted pod's last state is kept (`WatchCache.departed`): a pod that a drain
# evicted is gone from the API seconds later, often before a pass saw it deleting (the
# operator that led may be on the drained node; its successor takes the Lease up to 15 s
# later). Its DELETED event still carries its last status, whose DisruptionTarget condition
# tells a requested eviction from a pod that simply vanished.
DEPARTED_S = 180.0


def _rv(obj: dict) -> int:
    """The resourceVersion as an integer (opaque by contract, an etcd revision in practice)."""
    raw = (obj.get("metadata") or {}).get("resourceVersion") or "0"
    return int(raw) if raw.isascii() and raw.isdigit() else 0


def _name(obj: dict) -> str:
    return (obj.get("metadata") or {}).get("name", "")


class _Objects:
    """One listed set of objects (a job's pods, or the nodes), kept current by events."""

    def __init__(self) -> None:
        self.items: dict[str, dict] = {}
        self.departed: dict[str, tuple[dict, float]] = {}  # name -> (its DELETED event's object, when)
        self.listed_at: float | None = None
        # name -> (resourceVersion, what `observe` made of it): unchanged objects are not
        # observed again (a 2,000-pod job's pass otherwise spends most of its CPU there).
        self.observed: dict[str, tuple[int, Any]] = {}

    def observe(self, observe: Callable[[dict], Any]) -> list[Any]:
        out, memo = [], {}
        for name, obj in self.items.items():
            rv = _rv(obj)
            seen = self.observed.get(name)
            memo[name] = seen if seen is not None and seen[0] == rv else (rv, observe(obj))
            out.append(memo[name][1])
        self.observed = memo  # objects gone are forgotten
        return out

    def apply(self, kind: str | None, obj: dict, now: float) -> None:
        name = _name(obj)
        if kind == "DELETED":
            if name in self.items and _rv(self.items[name]) <= _rv(obj):
                del self.items[name]
            self.departed[name] = (obj, now)
            self.forget_departed(now)
            return
        if name not in self.items or _rv(self.items[name]) <= _rv(obj):
            self.items[name] = obj

    def forget_departed(self, now: float) -> None:
        for name in [n for n, (_, at) in self.departed.items() if now - at >= DEPARTED_S]:
            del self.departed[name]

    def seed(self, listed: list[dict], list_rv: int, now: float) -> None:
        fresh = {_name(o): o for o in listed}
        for name, cached in self.items.items():
            if name in fresh and _rv(cached) > _rv(fresh[name]):
                fresh[name] = cached  # an event newer than the list
            elif name not in fresh and _rv(cached) > list_rv:
                fresh[name] = cached  # created after the list was taken
        self.items, self.listed_at = fresh, now


@dataclass
class _Job:
    body: dict | None  # None: deleted (a tombstone at resourceVersion `rv`)
    rv: int
    read_at: float | None = None  # when it was last read from the API (None: only seen in events)


def _generation(body: dict | None) -> tuple[int, bool]:
    meta = (body or {}).get("metadata") or {}
    return meta.get("generation", 0), bool(meta.get("deletionTimestamp"))


class WatchCache:
    def __init__(self, resync_s: float = RESYNC_S, clock: Callable[[], float] = time.monotonic):
        self.resync_s, self.clock = resync_s, clock
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._pods: dict[tuple[str, str], _Objects] = {}
        self._nodes = _Objects()

    def _put_job(self, kind: str | None, body: dict, read_at: float | None = None) -> _Job | None:
        """Keep `body` if it is newer than what is cached; returns what was cached before."""
        meta = body.get("metadata") or {}
        key, rv = (meta.get("namespace", ""), _name(body)), _rv(body)
        was = self._jobs.get(key)
        if was is not None and was.rv > rv:
            if read_at is not None:
                was.read_at = read_at  # events brought a newer one than the read: as fresh
            return was  # late: the view never rolls back
        fresh = _Job(None if kind == "DELETED" else body, rv, read_at)
        if read_at is None and was is not None:
            fresh.read_at = was.read_at
        self._jobs[key] = fresh
        return was

    # --- from the watches (kopf's event loop) ---------------------------------------------------
    def job_event(self, kind: str | None, job: dict) -> bool:
        """A TrainingJob event; True when it changes more than status (its spec, a deletion),
        which a pass should see at once."""
        with self._lock:
            was = self._put_job(kind, job)
        if was is not None and was.rv > _rv(job):
            return False  # late: not kept
        return kind == "DELETED" or was is None or _generation(was.body) != _generation(job)

    def wrote_job(self, job: dict) -> None:
        """The job as the API server returned it after one of the operator's own writes."""
        with self._lock:
            self._put_job("MODIFIED", job)

    def drop_job(self, namespace: str, name: str) -> None:
        """Read the job from the API on the next pass (a write computed from the cached one failed)."""
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def pod_event(self, kind: str | None, pod: dict) -> None:
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(contract.LABEL_JOB)
        if not job:
            return
        with self._lock:
            self._pods.setdefault((meta.get("namespace", ""), job), _Objects()).apply(kind, pod, self.clock())

    def node_event(self, kind: str | None, node: dict) -> None:
        with self._lock:
            self._nodes.apply(kind, node, self.clock())

    def forget_job(self, namespace: str, job: str) -> None:
        with self._lock:
            self._pods.pop((namespace, job), None)
            self._jobs.pop((namespace, job), None)

    # --- for a reconcile pass (its thread) --------------------------------------------------------
    def job(self, namespace: str, name: str, get_job: Callable[[], dict | None]) -> dict | None:
        """The job (None: it is gone); `get_job()` reads it from the API when a read is due: on
        the first pass, after a tombstone or a dropped entry, and every `resync_s`."""
        key = (namespace, name)
        with self._lock:
            cached = self._jobs.get(key)
            if (cached is not None and cached.body is not None and cached.read_at is not None
                    and self.clock() - cached.read_at < self.resync_s):
                return cached.body
        body = get_job()
        if body is None:
            return None
        with self._lock:
            self._put_job("MODIFIED", body, read_at=self.clock())
            return self._jobs[key].body
    def pods(self, namespace: str, job: str, list_pods: Callable[[], tuple[list[dict], int]],
             observe: Callable[[dict], Any] | None = None) -> list:
        """The job's pods; `list_pods()` -> (items, the list's resourceVersion) when a list is due.
        With `observe`, what it makes of each pod, made again only for pods that changed."""
        key = (namespace, job)
        with self._lock:
            objs = self._pods.setdefault(key, _Objects())
            due = objs.listed_at is None or self.clock() - objs.listed_at >= self.resync_s
        if due:
            items, rv = list_pods()
            with self._lock:
                self._pods.setdefault(key, _Objects()).seed(items, rv, self.clock())
        with self._lock:
            objs = self._pods[key]
            return objs.observe(observe) if observe is not None else list(objs.items.values())

    def departed(self, namespace: str, job: str, observe: Callable[[dict], Any]) -> list:
        """What `observe` makes of the job's pods deleted in the last `DEPARTED_S`, from the last
        state their DELETED events carried (this instance's watch saw them, leader or not)."""
        with self._lock:
            objs = self._pods.get((namespace, job))
            if objs is None:
                return []
            objs.forget_departed(self.clock())
            bodies = [body for body, _ in objs.departed.values()]
        return [observe(body) for body in bodies]

    def nodes(self, list_nodes: Callable[[], tuple[list[dict], int]]) -> list[dict]:
        with self._lock:
            due = self._nodes.listed_at is None or self.clock() - self._nodes.listed_at >= self.resync_s
        if due:
            items, rv = list_nodes()
            with self._lock:
                self._nodes.seed(items, rv, self.clock())
        with self._lock:
            return list(self._nodes.items.values())
