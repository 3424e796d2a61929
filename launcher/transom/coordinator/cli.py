"""`transom coordinator`: one job's coordinator as a process (what the operator runs per job).

Its flags say the job's shape and timers (`Settings`), where its credentials come from, and
whether it talks to Kubernetes:

- the job's token (`TRANSOM_COORDINATOR_TOKEN` or `--token-file`), which may act for any replica;
- how replicas prove who they are (coordinator/identity.py): `--replica-key-file` (keys
  minted with that secret, as `transom run` does in its own process), and
  `--worker-service-account` (a worker pod's own projected token, checked with a
  TokenReview: kube_identity.py);
- `--kube-status`: write `status.training` of the TrainingJob. Both Kubernetes parts use the
  pod's ServiceAccount, or `--kube-api/--kube-token-file/--kube-ca-file` from outside a
  cluster (tests).

Every bad flag or contradiction exits 2 with one line before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from transom import contract, flags
from transom.arguments import between, seconds
from transom.defaults import LOCAL

# The flags that are Settings' fields as they are (flags.py derives them).
SETTINGS_FLAGS = ("num_replicas", "min_replicas", "heartbeat_interval_s", "heartbeat_timeout_s", "failed_grace_s",
                  "round_timeout_s", "startup_wait_s", "quorum_lease_s")
RENAMED = {"num_replicas": "--replicas"}


def add_arguments(c: argparse.ArgumentParser) -> None:
    from transom.coordinator.settings import Settings

    c.add_argument("--host", default="0.0.0.0")
    c.add_argument("--port", type=between(0, 65535), default=8080)
    c.add_argument("--job", default=os.environ.get(contract.ENV_JOB, "local"))
    flags.add(c, Settings, SETTINGS_FLAGS, required=("num_replicas",), renamed=RENAMED)
    c.add_argument("--token-file", help=f"file holding the job token (default: ${contract.ENV_COORDINATOR_TOKEN})")
    c.add_argument("--replica-key-file", help="file holding the secret that replica keys are signed with "
                                              "(coordinator/identity.py ReplicaKeys)")
    c.add_argument("--worker-service-account", metavar="NAME",
                   help="accept the projected tokens of this ServiceAccount's pods in --namespace as their "
                        "replicas' identities (TokenReview; the operator passes <job>-worker)")
    c.add_argument("--kube-status", action="store_true",
                   help="write status.training of the TrainingJob (in-cluster ServiceAccount)")
    c.add_argument("--namespace", default=None, help=f"the job's namespace (default: ${contract.ENV_NAMESPACE})")
    c.add_argument("--status-interval", type=seconds, default=LOCAL.status_interval_s,
                   help="seconds between status writes")
    c.add_argument("--kube-api", help="API server URL, to reach Kubernetes from outside a cluster (tests)")
    c.add_argument("--kube-token-file", help="with --kube-api: file holding a ServiceAccount token")
    c.add_argument("--kube-ca-file", help="with --kube-api: the API server's CA certificate")
    c.add_argument("--detection", default=os.environ.get(contract.ENV_DETECTION),
                   help=f"spec.detection as JSON (default: ${contract.ENV_DETECTION}, else the CRD's defaults)")


def settings_of(args: argparse.Namespace):
    """The coordinator's Settings from its flags; ValueError names a bad flag or a contradiction."""
    from transom.coordinator.settings import Settings

    return flags.build(Settings, args, SETTINGS_FLAGS, RENAMED, job=args.job)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(1 << 16).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} {path}: {e}") from None


def _kube_api(args: argparse.Namespace):
    from transom.coordinator.kube_api import KubeApi

    if args.kube_api:
        if not (args.kube_token_file and args.kube_ca_file):
            raise ValueError("--kube-api needs --kube-token-file and --kube-ca-file")
        return KubeApi(args.kube_api, Path(args.kube_token_file), Path(args.kube_ca_file))
    return KubeApi.in_cluster()


def _parts(args: argparse.Namespace) -> dict:
    """Everything the server is made of, from the flags; ValueError for what does not fit."""
    from transom.coordinator.identity import ReplicaKeys
    from transom.detect.step_rows import DetectionSettings

    settings = settings_of(args)  # the flags first: what is wrong with them needs no token to say
    token = _read(args.token_file, "--token-file") if args.token_file else \
        os.environ.get(contract.ENV_COORDINATOR_TOKEN, "")
    if not token:
        raise ValueError(f"a token is required ({contract.ENV_COORDINATOR_TOKEN} or --token-file)")
    parts: dict = {"settings": settings, "token": token,
                   "detection": DetectionSettings.from_spec(args.detection)}
    if args.replica_key_file:
        parts["replica_keys"] = ReplicaKeys(args.job, _read(args.replica_key_file, "--replica-key-file").encode())
    kube = args.kube_status or args.kube_api or args.worker_service_account
    if kube:
        namespace = args.namespace or os.environ.get(contract.ENV_NAMESPACE, "")
        if not namespace:
            raise ValueError(f"--namespace (or {contract.ENV_NAMESPACE}) is needed to talk to Kubernetes")
        api = _kube_api(args)
        if args.kube_status or args.kube_api:
            from transom.coordinator.kube_status import StatusWriter
            parts["status_writer"] = StatusWriter(api, namespace, args.job, args.status_interval)
        if args.worker_service_account:
            from transom.coordinator.kube_identity import KubeIdentity
            parts["kube_identity"] = KubeIdentity(api, namespace, args.job, args.worker_service_account)
    return parts


def main(args: argparse.Namespace) -> int:
    from transom.coordinator.server import CoordinatorServer

    try:
        parts = _parts(args)
    except ValueError as e:
        print(f"transom coordinator: {e}", file=sys.stderr)
        return contract.EXIT_USAGE

    async def serve() -> None:
        server = CoordinatorServer(**parts)
        await server.start(args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(serve())
    return contract.EXIT_OK
