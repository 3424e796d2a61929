"""Fault injection for tests and demos: real signals, sent by the worker to itself.

`TRANSOM_FAULT` holds faults separated by `;`, the k-th for the replica's k-th attempt
(launcher restart), each `ACTION:step=S[,rank=R][,phase=P]`:

    kill   SIGKILL this worker (a crash: no cleanup, no goodbye)
    stop   SIGSTOP this worker (a hang: the process exists but does nothing)
    raise  raise RuntimeError (a software fault the launcher restarts in place)

`phase` is `allreduce` (default: just before the cross-replica all-reduce, so the peers
are already waiting in it) or `forward` (at the start of the step), where `step` is the
step number; or, where `step` counts events instead: `catchup` (a replica that catches up
from its peers, at the end of its `step`-th step doing so: a joiner that dies while
joining) and `serve` (a source, when it is asked for its `step`-th chunk of a snapshot, before
it sends it: a peer that dies mid-transfer). The local runner gives a replica's k-th fault to its k-th incarnation,
so a restarted replica does not fail again unless asked to.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ACTIONS = ("kill", "stop", "raise")
PHASES = ("allreduce", "forward", "catchup", "serve")


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int = 0
    phase: str = "allreduce"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        action, _, rest = text.partition(":")
        if action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {action!r}")
        fields: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"fault field must be key=value, got {part!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"step", "rank", "phase"}
        if unknown:
            raise ValueError(f"unknown fault fields {sorted(unknown)}")
        if "step" not in fields or not fields["step"].isdigit():
            raise ValueError("fault needs step=<non-negative integer>")
        phase = fields.get("phase", "allreduce")
        if phase not in PHASES:
            raise ValueError(f"fault phase must be one of {PHASES}, got {phase!r}")
        return cls(action=action, step=int(fields["step"]), rank=int(fields.get("rank", "0")), phase=phase)

    def maybe_fire(self, step: int, rank: int, phase: str) -> None:
        if step != self.step or rank != self.rank or phase != self.phase:
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise RuntimeError(f"injected fault at step {step}")


def parse_targeted(text: str) -> tuple[int, str]:
    """`transom run --inject kill:replica=1,step=20` -> (1, "kill:step=20"), validated."""
    action, _, rest = text.partition(":")
    replica = None
    kept = []
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key.strip() == "replica":
            if not value.strip().isdigit():
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


def from_environ(attempt: int, environ: dict[str, str] | None = None) -> Fault | None:
    """The fault meant for this attempt of the replica, if any."""
    faults = parse_list((environ if environ is not None else os.environ).get("TRANSOM_FAULT", ""))
    return faults[attempt] if attempt < len(faults) else None
