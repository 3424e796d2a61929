"""The `transom` command: `coordinator`, `launch` (in a pod), `run` (local mode), `detect replay`,
`simulate`, `checkpoint export` and `check` (the pre-flight checks).

Importing this module needs no torch: the launcher and coordinator run in images or
environments where only the workers have it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from transom import contract, flags

if TYPE_CHECKING:
    from transom.coordinator.membership import Settings


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def coordinator_settings(args: argparse.Namespace) -> Settings:
    """The coordinator's Settings from its flags (coordinator/cli.py)."""
    from transom.coordinator import cli as coordinator_cli

    return coordinator_cli.settings_of(args)


def _launch(args: argparse.Namespace, command: list[str]) -> int:
    from transom.launch import processes
    from transom.launch.config import LaunchConfig
    from transom.launch.supervisor import Launcher

    if args.nproc_per_node is not None:  # the flags first, before the environment they override
        try:
            flags.build(LaunchConfig, args, (*LAUNCH_FLAGS, "nproc_per_node"), command=command)
        except ValueError as e:
            print(f"transom launch: {e}", file=sys.stderr)
            return contract.EXIT_USAGE
    owner = os.environ.get(contract.ENV_OWNER_PID)
    if owner and owner.isascii() and owner.isdigit() and not processes.follow_parent(int(owner)):
        print("transom launch: the `transom run` that started it is gone", file=sys.stderr)
        return 128 + signal.SIGTERM

    try:
        env = contract.ReplicaEnv.from_environ()
        if env.is_spare and env.nnodes > 1:
            # The nodes of a multi-node replica find each other through the coordinator under
            # the replica's identity, which a spare does not have yet: its workers start once
            # it is promoted.
            code = _wait_as_spare()
            if code is not None:
                return code
            env = contract.ReplicaEnv.from_environ()
        nproc = args.nproc_per_node if args.nproc_per_node is not None else env.nproc_per_node
        from transom.detect.step_rows import DetectionSettings
        config = flags.build(LaunchConfig, args, LAUNCH_FLAGS, command=command, nproc_per_node=nproc,
                             detection=DetectionSettings.from_spec(os.environ.get(contract.ENV_DETECTION)))
        launcher = Launcher(config, env)
    except ValueError as e:
        print(f"transom launch: {e}", file=sys.stderr)
        return contract.EXIT_USAGE
    return launcher.run()


def _wait_as_spare() -> int | None:
    """Block until the operator promotes this (multi-node) spare pod; None once it is a replica."""
    from transom.launch import spare

    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: received.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        directory = spare.podinfo_dir()
        logging.getLogger("transom.launch").info(
            "spare %s: waiting for a replica identity in %s", os.environ[contract.ENV_SPARE_ID], directory)
        found = spare.wait_for_assignment(directory, lambda: bool(received))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if found is None:
        return 128 + received[0]
    logging.getLogger("transom.launch").info(
        "spare %s promoted to replica %d generation %d",
        os.environ[contract.ENV_SPARE_ID], found.replica_id, found.generation)
    # The workers inherit os.environ: they must see the replica identity too.
    new_env = spare.promoted_environ(os.environ, found)
    os.environ.clear()
    os.environ.update(new_env)
    return None


# `transom run`'s flags that are RunConfig's fields as they are (flags.py derives them).
RUN_FLAGS = ("replicas", "nproc_per_replica", "min_replicas", "spares", "summary_json", "stats_dir",
             "collective_timeout_s", "heartbeat_timeout_s", "max_restarts", "timeout_s", "quiet", "log_dir",
             "job_name", "checkpoint_interval", "checkpoint_keep", "detection", "preflight", "trace_out",
             "end_margin", "backend")
LAUNCH_FLAGS = ("max_restarts",)


def _run(args: argparse.Namespace, command: list[str]) -> int:
    from transom.inject import parse_targeted
    from transom.launch.config import RunConfig
    from transom.launch.end_on import Awaited
    from transom.launch.local import LocalRun

    uri = args.checkpoint_uri or ""
    try:
        config = flags.build(RunConfig, args, RUN_FLAGS, command=command,
                             injects=[parse_targeted(spec) for spec in args.inject],
                             end_on=[Awaited.parse(text) for text in args.end_on],
                             checkpoint_uri=os.path.abspath(uri) if uri and "://" not in uri else uri)
    except ValueError as e:
        print(f"transom run: {e}", file=sys.stderr)
        return contract.EXIT_USAGE
    return LocalRun(config).run()


def _run_arguments(r: argparse.ArgumentParser) -> None:
    """`transom run`'s options: RunConfig's fields (their bounds, defaults and help), and the
    repeatable ones this function parses into them."""
    from transom.launch.config import RunConfig

    flags.add(r, RunConfig, RUN_FLAGS, required=("replicas",))
    r.add_argument(
        "--inject", action="append", default=[], metavar="ACTION:replica=I,step=S",
        help="inject a fault (kill, stop, raise, hang, slow, nan, bitflip, oom: transom/inject.py); repeatable",
    )
    r.add_argument("--checkpoint-uri", help=RunConfig.model_fields["checkpoint_uri"].description)
    r.add_argument("--end-on", action="append", default=[], metavar="KIND[:REPLICA]",
                   help="end the job --end-margin steps after this coordinator event (caught_up:1, verdict, "
                        "resumed...; launch/end_on.py); repeatable: after all of them. The script's step count "
                        "stays the cap, and the summary's end_on says whether the events came first")


def parser() -> argparse.ArgumentParser:
    from transom.launch.config import LaunchConfig

    p = argparse.ArgumentParser(prog="transom", description="Fault-tolerant PyTorch training")
    sub = p.add_subparsers(dest="cmd", required=True)

    from transom.coordinator import cli as coordinator_cli
    coordinator_cli.add_arguments(sub.add_parser("coordinator", help="run a job's coordinator (HTTP API)"))

    la = sub.add_parser("launch", help="supervise this node's workers (what each pod runs)")
    la.add_argument("--nproc-per-node", metavar="N", help="workers of this node (default: the pod's "
                                                         f"{contract.ENV_NPROC_PER_NODE})")
    flags.add(la, LaunchConfig, LAUNCH_FLAGS)

    _run_arguments(sub.add_parser("run", help="run a whole fault-tolerant job locally"))
    d = sub.add_parser("detect", help="anomaly detection over recorded traces")
    dsub = d.add_subparsers(dest="detect_cmd", required=True)
    from transom.detect import replay
    replay.add_arguments(dsub.add_parser("replay", help="run the detectors over a trace and print the verdicts"))
    from transom.simulate import cli as simulate_cli
    simulate_cli.add_arguments(sub.add_parser("simulate", help="goodput of large jobs under failures, by strategy"))
    from transom.checkpoint import cli as checkpoint_cli
    checkpoint_cli.add_arguments(sub.add_parser("checkpoint", help="committed checkpoints: export one as a plain "
                                                                  "PyTorch file"))
    from transom.check import cli as check_cli
    check_cli.add_arguments(sub.add_parser("check", help="run the pre-flight checks on this machine"))
    return p


def main(argv: list[str] | None = None) -> int:
    own, command = _split_command(list(sys.argv[1:] if argv is None else argv))
    args = parser().parse_args(own)
    logging.basicConfig(
        level=os.environ.get(contract.ENV_LOG_LEVEL, "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.cmd == "coordinator":
        from transom.coordinator import cli as coordinator_cli
        return coordinator_cli.main(args)
    if args.cmd == "launch":
        return _launch(args, command)
    if args.cmd == "simulate":
        from transom.simulate import cli as simulate_cli
        return simulate_cli.main(args)
    if args.cmd == "detect":
        from transom.detect import replay
        return replay.main(args)
    if args.cmd == "checkpoint":
        from transom.checkpoint import cli as checkpoint_cli
        return checkpoint_cli.main(args)
    if args.cmd == "check":
        from transom.check import cli as check_cli
        return check_cli.main(args)
    return _run(args, command)
