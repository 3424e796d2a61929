"""Which failure a replica's run names when one of its processes dies: the dead process's
signal, not a survivor's collective error (ft/peer_loss.py, launch/processes.py `to_blame`).

The messages are those torch 2.x printed in a 2 x 2 DDP run whose rank 1 was SIGKILLed."""

from __future__ import annotations

import signal

import pytest

from transom.ft.peer_loss import ECHO_GRACE_S, echo_report, lost_a_peer
from transom.launch.processes import to_blame

GLOO_CLOSED = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                           "by peer [127.0.0.1]:31151. This is typically caused by a remote worker crashing.")
GLOO_RESET = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.7]:1234: "
                          "Connection reset by peer")


class DistBackendError(RuntimeError):
    """torch.distributed's class of that name (NCCL's errors), told by its name."""


def raised_from(cause: BaseException) -> BaseException:
    try:
        raise RuntimeError("the step failed") from cause
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("exc, echo", [
    (GLOO_CLOSED, True),
    (GLOO_RESET, True),
    (DistBackendError("NCCL error: remote process exited or there was a network error"), True),
    (raised_from(GLOO_CLOSED), True),  # a script that wrapped it
    (ConnectionResetError("Connection reset by peer"), False),  # a download's, say: the worker's own failure
    (RuntimeError("injected fault at step 10"), False),
    (None, False),
])
def test_a_collective_error_saying_the_peer_went_away_is_an_echo(exc, echo):
    assert lost_a_peer(exc) is echo


def test_an_echo_is_reported_late_and_not_as_the_cause():
    reason, wait_s = echo_report("closed at step 10, before the target 40: RuntimeError: ...", GLOO_CLOSED)
    assert wait_s == ECHO_GRACE_S > 0.2  # longer than the launcher's poll and report
    assert reason.endswith("(a peer process of this replica went away first: its exit, which its launcher "
                           "reports, is the cause)")
    assert echo_report("uncaught RuntimeError in rank 0: a bug", RuntimeError("a bug")) == \
        ("uncaught RuntimeError in rank 0: a bug", 0.0)


@pytest.mark.parametrize("codes, blamed", [
    ([None, None], None),
    ([0, None], None),
    ([None, -signal.SIGKILL], 1),
    ([1, -signal.SIGKILL], 1),  # rank 0's error echoes rank 1's death: the signal is the cause
    ([1, None], 0),
    ([None, 1, 2], 1),
    ([-signal.SIGTERM, -signal.SIGKILL], 0),
])
def test_the_launcher_blames_a_worker_killed_by_a_signal_first(codes, blamed):
    assert to_blame(codes) == blamed
