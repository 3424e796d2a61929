"""What a replica may claim about its progress: only steps it could have committed.

A member of a round commits at most one step under it, and nothing without a round. So the
coordinator bounds every step a replica states (in a quorum request, heartbeat, leave,
checkpoint report, registration or signal row) by what its rounds allow:

- answered by a round whose `max_step` was m: at most m + 1; by a round that granted a
  lease up to step h (lease.py): at most h + 1;
- registered but not answered yet: at most the step it registered with (it holds that
  state, restored or kept, and commits nothing before a round answers it);
- a registration, once this coordinator decided a round: at most one past the newest step
  any round decided (`step_limit`).

A claim past its bound is refused with a ValueError (HTTP 400) and changes nothing. Without
this one replica could claim a huge step and become every joiner's recovery source, ratchet
the job's step, complete the job, or move the detectors' judged-up-to mark past every real
step. Completing the job needs an answered round as well: a replica that no round answered
has trained nothing under this coordinator.

Before this coordinator decided any round (a new job, or one whose coordinator restarted)
no round bounds a registration, so no step is believed on one replica's word
(`believed_step`): before the first round, the step that two replicas registered with at
least (the second-highest registration; once there is a round, one past its newest
step). An honest replica that alone kept its state through a coordinator restart looks
the same as one that lies, so:

- the first round fails a member holding state whose step is past that by more than
  FIRST_ROUND_STEP_WINDOW (`unsupported`): it restarts from the checkpoint and rejoins,
  instead of every other replica taking its word for the job's state (a lone registration
  at 2^62 - 1 would otherwise become the source every other replica recovers from);
- a checkpoint report past it is held, and counted (status.training.lastCheckpoint) only
  once a second registration or a round supports it;
- a signal row past it is dropped: the detectors' state lasts the whole job, and a row at
  2^62 would have every real step judged on one launcher's rows (the others' "late").

Pure functions over `Membership`'s records, called under the server's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transom.coordinator.job_state import JobState
    from transom.coordinator.models import QuorumRequest

# A signal row describes a step already committed; rows a little ahead of the bound are
# tolerated only because a launcher's rows and its leader's quorum requests travel apart.
SIGNAL_STEP_WINDOW = 1
# Honest replicas registering with a restarted coordinator are at most a step apart: one may
# have had the last round's answer and trained its step while the other's request was lost.
FIRST_ROUND_STEP_WINDOW = 1


def step_limit(m: JobState, replica_id: int) -> tuple[int, str] | None:
    """The most committed steps replica `replica_id`'s live incarnation can hold, and why;
    None when nothing bounds it (registered before this coordinator's first round)."""
    answered = m.answers.get(replica_id)
    if answered is not None and answered.holds_until is not None:
        return answered.holds_until + 1, f"one past the lease of round {answered.round} (step {answered.holds_until})"
    if answered is not None:
        return answered.max_step + 1, f"one past round {answered.round} (step {answered.max_step})"
    rep = m.replicas.get(replica_id)
    if rep is not None:
        return rep.registered_step, "the step it registered with: no round has answered it yet"
    if m.current is not None:
        return m.step_limit, "one past the newest step of any round"
    return None


def check(m: JobState, replica_id: int, step: int, what: str) -> None:
    """ValueError if `step` is more than replica `replica_id` can have committed."""
    bound = step_limit(m, replica_id)
    if bound is not None and step > bound[0]:
        raise ValueError(f"{what} of replica {replica_id} claims step {step}, but it can hold at most "
                         f"{bound[0]} committed steps ({bound[1]})")


def check_registration(m: JobState, replica_id: int, step: int) -> None:
    """ValueError if a new registration claims more than any round allowed."""
    if m.current is not None and step > m.step_limit:
        raise ValueError(f"registration of replica {replica_id} claims step {step}, but no replica can hold more "
                         f"than {m.step_limit} committed steps (one past the newest step of any round)")


def supported(m: JobState, step: int) -> bool:
    """Whether the job's evidence supports `step` committed steps (`believed_step`)."""
    believed = believed_step(m)
    return believed is not None and step <= believed


def unsupported(m: JobState, ready: Mapping[int, QuorumRequest]) -> dict[int, str]:
    """The members of a coordinator's first round that claim more than the others support, and
    why: those holding state past `believed_step` by more than FIRST_ROUND_STEP_WINDOW. Empty
    once a round was decided (rounds bound every claim from then on), and while only one
    replica registered: nobody can contradict it."""
    believed = believed_step(m)
    if m.current is not None or believed is None:
        return {}
    ahead = [rid for rid, req in ready.items()
             if req.catching_up_from is None and req.step > believed + FIRST_ROUND_STEP_WINDOW]
    return {rid: (f"registered at step {ready[rid].step}, but no other replica holds more than {believed} "
                  "committed steps; it restarts from the checkpoint") for rid in ahead}


def check_completion(m: JobState, replica_id: int, step: int) -> None:
    """ValueError unless replica `replica_id` may say the job completed at `step`."""
    if replica_id not in m.answers:
        raise ValueError(f"replica {replica_id} cannot complete the job at step {step}: no round has answered it "
                         "(a replica commits steps only in rounds)")


def believed_step(m: JobState) -> int | None:
    """The most committed steps the job's evidence supports: one past the newest step of any
    decided round; before the first round, the step that two replicas registered with at
    least (None while fewer registered). One replica's registration alone moves it only in
    a job of one replica."""
    if m.current is not None:
        return m.step_limit
    witnesses = min(2, m.settings.num_replicas)
    registered = sorted((rep.registered_step for rep in m.replicas.values()), reverse=True)
    return registered[witnesses - 1] if len(registered) >= witnesses else None


def signal_step_ok(m: JobState, replica_id: int, step: int) -> bool:
    """A signal row of `step` describes a step replica `replica_id` could have trained, and
    one the job's evidence says some replica could have (`believed_step`)."""
    bound = step_limit(m, replica_id)
    believed = believed_step(m)
    return (bound is None or step <= bound[0] + SIGNAL_STEP_WINDOW) and believed is not None \
        and step <= believed + SIGNAL_STEP_WINDOW
