"""Fault injection for tests and demos: real faults, which the worker causes itself (signals, memory).

`TRANSOM_FAULT` holds faults separated by `;`, the k-th for the replica's k-th attempt
(launcher restart), each `ACTION:step=S[,rank=R][,phase=P][,replica=I][,node=NAME]`:

    kill    SIGKILL this worker (a crash: no cleanup, no goodbye)
    stop    SIGSTOP this worker (a hang: the process exists but does nothing)
    raise   raise RuntimeError (a software fault the launcher restarts in place)
    hang    sleep forever in the step, in Python (a deadlock: threads, heartbeats and stack
            dumps still work)
    slow    sleep (factor-1) x the step's own busy time at its end (a degraded device),
            for `count` steps from `step` (default: the rest of the run)
    nan     a NaN into this rank's gradients before the exchange, `count` steps (default 1)
    bitflip flip one bit of this rank's first parameter after the update of `step`
            (silent data corruption)
    oom     allocate and touch memory in 64 MiB chunks until the kernel's OOM killer ends
            the worker (a container over its memory limit), at `step` or the first step
            after it that this attempt reaches (a restarted replica joins later). At most
            `mb` MiB (default: twice the memory limit of the worker's cgroup; without a
            limit it raises instead of exhausting the machine)
    corrupt the pre-flight compute check's device result is corrupted (one element off by a
            large amount), as on a device that computes wrong (transom/check/compute.py).
            Its phase is `preflight` (the default for it, and its only one)

`phase` (kill, stop, raise, oom) is `allreduce` (default: just before the cross-replica all-reduce, so the peers
are already waiting in it) or `forward` (at the start of the step), where `step` is the
step number; or, where `step` counts events instead: `catchup` (a replica that catches up
from its peers, at the end of its `step`-th step doing so: a joiner that dies while
joining), `serve` (a source, when it is asked for its `step`-th chunk of a snapshot, before
it sends it: a peer that dies mid-transfer) and `checkpoint` (in the checkpoint thread, once
the snapshot of checkpoint `step` is taken and before the first object of its part is
written: a node stopped or cut off in the middle of a checkpoint; `stop` stops the whole
process there, whatever its training thread is doing). The local runner gives a replica's
k-th fault to its k-th incarnation, so a restarted replica does not fail again unless asked to.

`preflight` (corrupt only, and corrupt only there) is the launcher's pre-flight checks
(transom/check), where `step` counts the launcher's pre-flights: 0 is the first, and a
spare's periodic ones count up; it fires at pre-flights `step` .. `step + count - 1`
(`count` default 1). Pre-flight faults are not tied to an attempt: `preflight_faults` gives
the checks every one in the list (each still takes its attempt's place in it, so the
trainer sees no fault for that attempt).

The trainer never reads this module: `ft/hooks.py` builds its step hooks from
`from_environ` when a fault is meant for this attempt, and a no-op otherwise.

`replica=I` makes a fault fire only in replica I (TRANSOM_REPLICA_ID): a pod template's
environment is every replica's, so that is how a fault set there (`TRANSOM_FAULT` in
`spec.template`) reaches one replica. In a pod the list restarts with every generation.
`node=NAME` makes any fault fire only on the node NAME (TRANSOM_NODE_NAME, the pod's
spec.nodeName): the way to make one node bad whichever replica lands there.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

from transom import contract

ACTIONS = ("kill", "stop", "raise", "hang", "slow", "nan", "bitflip", "oom", "corrupt")
PHASES = ("allreduce", "forward", "catchup", "serve", "checkpoint", "preflight")
PREFLIGHT = "preflight"  # the phase of the pre-flight checks: `corrupt`'s only one
# A Kubernetes node name (a DNS subdomain): anything else could never match spec.nodeName.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _natural(text: str) -> bool:
    """A non-negative integer in ASCII digits (str.isdigit() alone also takes '²', which int() refuses)."""
    return text.isascii() and text.isdigit()


FIELDS = {"step", "rank", "phase", "count", "factor", "replica", "mb", "node"}
# Where the step hooks (ft/hooks.py) offer each of the detection faults: they need what the step holds there.
FIXED_PHASE = {"hang": "allreduce", "slow": "end", "nan": "gradients", "bitflip": "update"}
FOREVER = 1 << 62
OOM_CHUNK = 64 << 20
PAGE = 4096


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int = 0
    phase: str = "allreduce"
    count: int = 1  # consecutive steps it fires at (slow, nan; oom: from `step` on)
    factor: float = 1.5  # slow
    replica: int | None = None  # fires only in this replica; None: in whichever replica runs it
    mb: int | None = None  # oom: the most it allocates, in MiB
    node: str | None = None  # fires only on this node (TRANSOM_NODE_NAME); None: on any

    @classmethod
    def parse(cls, text: str) -> Fault:
        action, _, rest = text.partition(":")
        if action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {action!r}")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"fault field must be key=value, got {part!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - FIELDS
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        if "step" not in fields or not _natural(fields["step"]):
            raise ValueError("fault needs step=<non-negative integer>")
        phase = _phase_of(action, fields.get("phase"))
        if "node" in fields and not _NODE_NAME.match(fields["node"]):
            raise ValueError(f"node must be a Kubernetes node name, got {fields['node']!r}")
        default_count = FOREVER if action in ("slow", "oom") else 1
        count = int(fields.get("count", default_count))
        factor = float(fields.get("factor", "1.5"))
        if count < 1 or not 1.0 < factor < 100.0:
            raise ValueError("count must be at least 1 and factor between 1 and 100")
        for key in ("replica", "mb"):
            if key in fields and not _natural(fields[key]):
                raise ValueError(f"{key} must be a non-negative integer, got {fields[key]!r}")
        if "mb" in fields and (action != "oom" or int(fields["mb"]) < 1):
            raise ValueError("mb is for oom only, and at least 1")
        return cls(action=action, step=int(fields["step"]), rank=int(fields.get("rank", "0")), phase=phase,
                   count=count, factor=factor, replica=int(fields["replica"]) if "replica" in fields else None,
                   mb=int(fields["mb"]) if "mb" in fields else None, node=fields.get("node"))

    def applies_here(self, environ: Mapping[str, str], replica: int | None) -> bool:
        """Whether this fault is meant for this process: its replica (`replica`: this one's
        index, None for a spare) and its node (environ's TRANSOM_NODE_NAME), where it names them."""
        if self.replica is not None and self.replica != replica:
            return False
        return self.node is None or self.node == environ.get(contract.ENV_NODE_NAME)

    def due(self, index: int) -> bool:
        """Whether it fires at the `index`-th event it counts (a step, a pre-flight...)."""
        return self.step <= index < self.step + self.count

    def maybe_fire(self, step: int, rank: int, phase: str, target=None, elapsed_s: float = 0.0) -> None:
        """Fire if this is the fault's step, rank and phase. `target`: the gradient (nan) or the
        parameter (bitflip) to corrupt; `elapsed_s`: the step's busy time so far (slow)."""
        if not (self.step <= step < self.step + self.count) or rank != self.rank or phase != self.phase:
            return
        if self.action == "slow":
            time.sleep((self.factor - 1.0) * elapsed_s)
        elif self.action == "nan":
            target.view(-1)[0] = float("nan")
        elif self.action == "bitflip":
            _flip_a_bit(target)
        elif self.action == "hang":
            while True:  # interruptible sleeps: the stack dump and SIGKILL still reach us
                time.sleep(1.0)
        elif self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "oom":
            _exhaust_memory(self.mb)
        elif self.action == "corrupt":
            return  # no step offers it: the pre-flight compute check applies it (transom/check/compute.py)
        else:
            raise RuntimeError(f"injected fault at step {step}")


def _phase_of(action: str, given: str | None) -> str:
    """The phase of an `action` fault from its `phase=` field (None: not given); ValueError
    for a phase the action does not take."""
    phase = given if given is not None else (PREFLIGHT if action == "corrupt" else "allreduce")
    if phase not in PHASES:
        raise ValueError(f"fault phase must be one of {PHASES}, got {phase!r}")
    if (action == "corrupt") != (phase == PREFLIGHT):
        raise ValueError(f"corrupt fires only in phase {PREFLIGHT}, and only corrupt does, got {action} "
                         f"with phase {phase}")
    if action in FIXED_PHASE:
        if given is not None:
            raise ValueError(f"{action} takes no phase: it fires where the step offers it")
        phase = FIXED_PHASE[action]
    return phase


def _flip_a_bit(param) -> None:
    """Flip the lowest mantissa bit of the first element, in place: a change no check of
    values would notice (1.0 becomes 1.0000001)."""
    import torch  # only workers inject this, and they have torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[param.element_size()]
    with torch.no_grad():
        bits = param.detach().view(-1)[:1].view(ints)
        bits ^= 1


def _exhaust_memory(mb: int | None) -> None:
    """Hold ever more touched memory until the OOM killer ends this process; RuntimeError
    after `mb` MiB (default twice the cgroup's limit) or at once without a known limit."""
    from transom.launch import oom

    cgroup = oom.find()
    limit = cgroup.limit() if cgroup is not None else None
    if mb is not None:
        cap = mb << 20
    elif limit is not None:
        cap = 2 * limit
    else:
        raise RuntimeError("injected oom: this process has no memory limit; refusing to exhaust the machine's "
                           "memory (give the fault mb=<MiB> to allocate that much anyway)")
    held: list[bytearray] = []
    while len(held) * OOM_CHUNK < cap:
        chunk = bytearray(OOM_CHUNK)
        chunk[::PAGE] = b"\x01" * (OOM_CHUNK // PAGE)  # touch every page: allocating alone maps none
        held.append(chunk)
    raise RuntimeError(f"injected oom: allocated {cap >> 20} MiB and was not OOM-killed")


def parse_targeted(text: str) -> tuple[int, str]:
    """`transom run --inject kill:replica=1,step=20` -> (1, "kill:step=20"), validated."""
    action, _, rest = text.partition(":")
    replica = None
    kept = []
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key.strip() == "replica":
            if not _natural(value.strip()):
                raise ValueError(f"replica must be a non-negative integer, got {value!r}")
            replica = int(value)
        else:
            kept.append(part)
    if replica is None:
        raise ValueError(f"--inject needs replica=<index>: {text!r}")
    spec = f"{action}:{','.join(kept)}"
    Fault.parse(spec)
    return replica, spec


def parse_list(text: str) -> list[Fault]:
    return [Fault.parse(part.strip()) for part in text.split(";") if part.strip()]


def from_environ(attempt: int, environ: Mapping[str, str] | None = None, replica: int | None = None) -> Fault | None:
    """The step's fault meant for this attempt of replica `replica` on this node, if any (a
    pre-flight fault in the attempt's place is the checks', not the step's: None)."""
    environ = environ if environ is not None else os.environ
    faults = parse_list(environ.get(contract.ENV_FAULT, ""))
    fault = faults[attempt] if attempt < len(faults) else None
    if fault is None or fault.phase == PREFLIGHT or not fault.applies_here(environ, replica):
        return None
    return fault


def preflight_faults(environ: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    """Every pre-flight fault of TRANSOM_FAULT (whichever attempt's place it takes) meant for
    this replica (TRANSOM_REPLICA_ID; a spare has none, so `replica=` faults skip it) on
    this node (TRANSOM_NODE_NAME). ValueError for a list that does not parse."""
    environ = environ if environ is not None else os.environ
    replica_text = environ.get(contract.ENV_REPLICA_ID, "")
    replica = int(replica_text) if _natural(replica_text) else None
    return tuple(f for f in parse_list(environ.get(contract.ENV_FAULT, ""))
                 if f.phase == PREFLIGHT and f.applies_here(environ, replica))
