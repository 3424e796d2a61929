"""`transom-operator`: run the operator from source (or in its image).

    transom-operator [--namespace NS ...] [--metrics-port 8080] [--coordinator-image IMG]

Credentials come from KUBECONFIG or the in-cluster ServiceAccount. Leader election on a
Lease in --lease-namespace makes a second instance stand by until the first stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading
import uuid

import kopf
from kubernetes import client, config
from prometheus_client import start_http_server

from transom import contract
from transom_operator import (
    handlers,  # noqa: F401  (registers the handlers)
    metrics,
)
from transom_operator.controller import DEFAULT_REQUEUE_S, Controller
from transom_operator.kube import Kube
from transom_operator.leader import LeaderElector

# The coordinator needs Python, transom and its light dependencies only: the operator's image.
DEFAULT_IMAGE = "ghcr.io/transom-io/transom-operator:0.1.0"

# The API server stores objects nested up to 10,000 levels (its JSON decoder's limit), and a
# pod template's unknown fields nest as deep as its author likes: a structural schema cannot
# bound them. With Python's default recursion limit (1,000), one such TrainingJob made the
# JSON parse of kopf's watch raise and the operator exit (every job unmanaged, again after
# each restart), and kopf's copy of it fail from ~500 levels on. With these the operator
# reads it, and the models refuse it (InvalidSpec, api_template.MAX_TEMPLATE_DEPTH).
MAX_OBJECT_DEPTH = 10_100  # the API server's limit, with a watch event's or list's envelope
RECURSION_LIMIT = 3 * MAX_OBJECT_DEPTH  # copy.deepcopy (kopf's diff base) takes 2 frames a level
# The C stack of every thread started from now on: parsing or comparing 10,000 levels takes
# about 2 MiB of it (measured on CPython 3.11), and a thread's default may be as small.
THREAD_STACK_BYTES = 16 * 2**20


def allow_deep_objects() -> None:
    """Let this process parse, copy and compare any object the API server can store."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    threading.stack_size(THREAD_STACK_BYTES)


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _default(name: str) -> object:
    """The default of the Controller's field `name`: its flag's too."""
    return next(f.default for f in dataclasses.fields(Controller) if f.name == name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transom-operator", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus port; 0 disables")
    p.add_argument("--metrics-address", default="0.0.0.0")
    p.add_argument("--health-port", type=int, default=0, help="liveness endpoint /healthz; 0 disables")
    p.add_argument("--coordinator-image", default=os.environ.get(contract.ENV_COORDINATOR_IMAGE, DEFAULT_IMAGE))
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    p.add_argument("--lease-name", default="transom-operator")
    p.add_argument("--resync-seconds", type=float, default=DEFAULT_REQUEUE_S,
                   help="longest time between two passes of a job")
    p.add_argument("--allow-node-taint", action="store_true",
                   help="carry out nodeExclusionPolicy Taint (else a job's blamed node is excluded for it only)")
    p.add_argument("--allow-node-cordon", action="store_true",
                   help="carry out nodeExclusionPolicy Cordon (else a job's blamed node is excluded for it only)")
    p.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=_default("network_policy"),
                   help="give every job a NetworkPolicy that admits only the job's own pods (default: on)")
    p.add_argument("--token-reviewer-role", default=_default("token_reviewer_role"),
                   help="ClusterRole that lets a job's coordinator create TokenReviews (bound per job): how it "
                        "checks which replica a worker pod's token speaks for")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:  # kopf logs every handler run at INFO: one line per pod event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    allow_deep_objects()  # before any thread starts
    api = _api_client()
    identity = f"{os.environ.get('POD_NAME', socket.gethostname())}-{uuid.uuid4().hex[:6]}"
    leader = LeaderElector(api, args.lease_namespace, args.lease_name, identity)
    allowed = (("Taint", args.allow_node_taint), ("Cordon", args.allow_node_cordon))
    node_actions = frozenset(a for a, on in allowed if on)
    controller = Controller(Kube(api), args.coordinator_image, node_actions, args.network_policy,
                            token_reviewer_role=args.token_reviewer_role)
    memo = kopf.Memo(controller=controller, leader=leader, wakeups={}, resync_s=args.resync_seconds)

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_):
        settings.posting.level = logging.WARNING  # our own Events carry the user-facing story
        settings.watching.server_timeout = 60
        # kopf's own requests (watches, finalizers, its Events) get bounds like kube.py's: a
        # watch that stays silent is reconnected after settings.watching.inactivity_timeout.
        settings.watching.connect_timeout = 10
        settings.networking.connect_timeout = 10
        settings.networking.request_timeout = 60
        settings.persistence.finalizer = "transom.io/operator"

    try:
        leader.start()
        if args.metrics_port:  # its daemon thread serves until the process ends
            start_http_server(args.metrics_port, addr=args.metrics_address, registry=metrics.REGISTRY)
        kopf.run(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=True,  # we elect a leader on a Lease instead of kopf's peering CRDs
            memo=memo,
            # Its own name for kopf too: kopf would ask getpass.getuser(), which raises for a
            # uid without a passwd entry (the image's 65532 under Docker or containerd).
            identity=identity,  # type: ignore[arg-type]  # kopf's Identity: a NewType of str, not exported
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
        )
    finally:
        controller.close()
        leader.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
