"""Where an attempt's world meets: MASTER_ADDR and MASTER_PORT for a replica's workers.

Found without cluster DNS: a single-node replica uses loopback; node 0 of a multi-node
replica picks a port, publishes its pod address through the coordinator under the
attempt's identity, and the other nodes read it there (a long-poll that a signal ends).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from transom import contract
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import Identity, RendezvousInfo

log = logging.getLogger("transom.launch")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_address(env: contract.ReplicaEnv, client: CoordinatorClient, identity: Callable[[], Identity], who: str,
                   timeout_s: float, stopped: Callable[[], bool]) -> tuple[str, int] | None:
    """MASTER_ADDR/PORT of this attempt's world; None if `stopped()` while waiting. `identity()`
    is asked only for a multi-node replica (a waiting spare, single-node, has none yet)."""
    if env.nnodes == 1:
        return "127.0.0.1", free_port()
    if env.node_rank == 0:
        port = free_port("0.0.0.0")
        info = RendezvousInfo(identity=identity(), master_addr=env.advertise_addr, master_port=port)
        client.put_rendezvous(info)
        return info.master_addr, port
    log.info("%s node %d: waiting up to %gs for node 0 to publish the replica's address", who, env.node_rank,
             timeout_s)
    found = client.get_rendezvous(identity(), timeout_s, stopped=stopped)
    return (found.master_addr, found.master_port) if found is not None else None
