"""Pre-flight checks: what a launcher measures on its node before its workers join training.

A node that computes wrong, whose memory does not hold a pattern, whose local ranks cannot
all-reduce, that cannot reach a peer or the checkpoint location, or whose disk or clock is
off, costs the whole job a failed step (or, worse, a silently wrong model) once it trains.
Checked first, it costs one pod start: the launcher exits with
`contract.EXIT_PREFLIGHT_FAILED` and a message from `failure_message`, and the replica is
placed elsewhere. The checks, in `contract.PREFLIGHT_CHECKS` order, one module each:

    compute     compute.py       a seeded float32 matmul against a float64 reference
    memory      memtest.py       a pattern written, read, inverted and read again
    collective  collective.py    an all-reduce among the replica's local processes
    link        link.py          a GET from a peer replica's state server
    storage     storage.py       an object written, read back and deleted at the checkpoint URI
    node        node.py          free disk for snapshots, and clock skew against the coordinator

`run_checks` (runner.py) runs them within one time budget; `transom check` (cli.py) runs
them by hand. Importing this package needs no torch: the checks that use it import it
when they run.
"""

from transom.check.context import CheckContext
from transom.check.result import CheckResult, failure_message
from transom.check.runner import run_checks

__all__ = ["CheckContext", "CheckResult", "failure_message", "run_checks"]
