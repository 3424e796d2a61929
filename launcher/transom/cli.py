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

from transom import contract
from transom.arguments import (
    MAX_KEEP,
    MAX_LAUNCH_RESTARTS,
    MAX_STEPS,
    between,
    count,
    non_negative,
    seconds,
    wait_seconds,
)

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
        config = LaunchConfig(command=command, nproc_per_node=nproc, max_restarts=args.max_restarts,
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


def _run(args: argparse.Namespace, command: list[str]) -> int:
    from transom.inject import parse_targeted
    from transom.launch.config import RunConfig
    from transom.launch.end_on import Awaited
    from transom.launch.local import LocalRun

    try:
        config = RunConfig(
            command=command,
            replicas=args.replicas,
            nproc_per_replica=args.nproc_per_replica,
            min_replicas=args.min_replicas,
            injects=[parse_targeted(spec) for spec in args.inject],
            summary_json=args.summary_json,
            stats_dir=args.stats_dir,
            collective_timeout_s=args.collective_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
            quiet=args.quiet,
            checkpoint_uri=os.path.abspath(args.checkpoint_uri)
            if args.checkpoint_uri and "://" not in args.checkpoint_uri
            else (args.checkpoint_uri or ""),
            checkpoint_interval=args.checkpoint_interval,
            job_name=args.job_name or "",
            checkpoint_keep=args.checkpoint_keep,
            backend=args.backend,
            log_dir=args.log_dir,
            spares=args.spares,
            detection=args.detection,
            preflight=args.preflight,
            trace_out=args.trace_out,
            end_on=[Awaited.parse(text) for text in args.end_on],
            end_margin=args.end_margin,
        )
    except ValueError as e:
        print(f"transom run: {e}", file=sys.stderr)
        return contract.EXIT_USAGE
    return LocalRun(config).run()


def _run_arguments(r: argparse.ArgumentParser) -> None:
    """`transom run`'s options (launch/config.py RunConfig holds their defaults)."""
    from transom.launch.config import RunConfig, default_of
    from transom.launch.end_on import MAX_MARGIN

    r.add_argument("--replicas", type=count, required=True)
    r.add_argument("--nproc-per-replica", type=count, default=default_of(RunConfig, "nproc_per_replica"))
    r.add_argument("--min-replicas", type=count, default=default_of(RunConfig, "min_replicas"))
    r.add_argument("--spares", type=non_negative, default=default_of(RunConfig, "spares"),
                   help="hot spares: launchers whose workers load the model and wait; a failed replica is replaced "
                        "by one at once (as spec.spareReplicas on Kubernetes)")
    r.add_argument(
        "--inject", action="append", default=[], metavar="ACTION:replica=I,step=S",
        help="inject a fault (kill, stop, raise, hang, slow, nan, bitflip, oom: transom/inject.py); repeatable",
    )
    r.add_argument("--summary-json", help="write the end summary here")
    r.add_argument("--stats-dir", help="keep the workers' per-step statistics here (default: a temp dir)")
    r.add_argument("--collective-timeout", type=wait_seconds, default=default_of(RunConfig, "collective_timeout_s"))
    r.add_argument("--heartbeat-timeout", type=wait_seconds, default=default_of(RunConfig, "heartbeat_timeout_s"))
    r.add_argument("--max-restarts", type=between(0, MAX_LAUNCH_RESTARTS),
                   default=default_of(RunConfig, "max_restarts"), help="in-place restarts per launcher")
    r.add_argument("--timeout", type=seconds, default=default_of(RunConfig, "timeout_s"),
                   help="give up after this many seconds")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--log-dir", help="write each replica's launcher and worker output to DIR/replica-<i>.log and the "
                                     "coordinator's log to DIR/coordinator.log; the terminal shows only the progress")
    r.add_argument("--checkpoint-uri",
                   help="checkpoint here (a directory or s3://bucket/prefix); a run resumes from it")
    r.add_argument("--job-name", metavar="NAME",
                   help="the job this run is: a checkpoint location belongs to one job, and a run of another name "
                        "is refused there; the same name continues the job (default: a fresh local-<hex> per run, "
                        "which the run prints)")
    r.add_argument("--checkpoint-interval", type=between(0, MAX_STEPS),
                   help="committed steps between checkpoints (the script may override)")
    r.add_argument("--checkpoint-keep", type=between(1, MAX_KEEP), help="committed checkpoints to keep")
    r.add_argument("--detection", metavar="JSON",
                   help='anomaly detection settings, as spec.detection (e.g. \'{"hangTimeoutSeconds": 60}\')')
    r.add_argument("--preflight", metavar="JSON",
                   help='pre-flight checks each launcher runs before its workers start, as spec.preflight (e.g. '
                        '\'{"checks": ["compute", "memory"]}\'); default: none')
    r.add_argument("--trace-out", metavar="FILE",
                   help="write every rank's step signals as one CSV trace (transom detect replay FILE)")
    r.add_argument("--end-on", action="append", default=[], metavar="KIND[:REPLICA]",
                   help="end the job --end-margin steps after this coordinator event (caught_up:1, verdict, "
                        "resumed...; launch/end_on.py); repeatable: after all of them. The script's step count "
                        "stays the cap, and the summary's end_on says whether the events came first")
    r.add_argument("--end-margin", type=between(0, MAX_MARGIN), default=default_of(RunConfig, "end_margin"),
                   help="steps the job trains after the --end-on events")
    r.add_argument("--backend", choices=contract.BACKENDS, default=default_of(RunConfig, "backend"),
                   help="torch.distributed backend (TRANSOM_BACKEND): auto picks NCCL only where each worker has a "
                        "GPU of its own and the tensors are on it, Gloo otherwise")


def parser() -> argparse.ArgumentParser:
    from transom.launch.config import LaunchConfig, default_of

    p = argparse.ArgumentParser(prog="transom", description="Fault-tolerant PyTorch training")
    sub = p.add_subparsers(dest="cmd", required=True)

    from transom.coordinator import cli as coordinator_cli
    coordinator_cli.add_arguments(sub.add_parser("coordinator", help="run a job's coordinator (HTTP API)"))

    la = sub.add_parser("launch", help="supervise this node's workers (what each pod runs)")
    la.add_argument("--nproc-per-node", type=count, default=None)
    la.add_argument("--max-restarts", type=between(0, MAX_LAUNCH_RESTARTS),
                    default=default_of(LaunchConfig, "max_restarts"))

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
