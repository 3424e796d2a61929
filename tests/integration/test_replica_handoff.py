"""The collectives of a replica's own ranks (ft/replica.py), between two real Gloo processes:
the leader's hand-off (JSON, not pickle) and the vote of several flags in one collective."""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from transom import contract
from transom.ft.replica import ReplicaContext, holding

LONG = "x" * 768
VALUES = [{"leased": "short"}, None, (3, 7), {"answer": LONG, "n": [1, 2]}, "", "é" * 256]


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        env = contract.ReplicaEnv.from_environ({
            contract.ENV_COORDINATOR_URL: "http://127.0.0.1:9", contract.ENV_COORDINATOR_TOKEN: "unused",
            contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1"})
        ctx = ReplicaContext(env=env, rank=rank, local_rank=rank, world_size=2, backend="gloo",
                             device=torch.device("cpu"), ctrl_group=holding(dist.new_group([0, 1], backend="gloo")))
        # Only the leader's value counts: the other rank offers something else.
        received = [ctx.from_leader(v if rank == 0 else "not mine") for v in VALUES]
        votes = [ctx.all_ok_each(rank == 0, True, rank == 1), ctx.all_ok_each(True), ctx.all_ok(rank == 0)]
        out.put((rank, received, votes))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_leader_hands_json_and_a_vote_of_several_flags_takes_one_collective() -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, "a rank failed (its traceback is above)"
    results = {r: (got, votes) for r, got, votes in (out.get(timeout=10) for _ in procs)}
    expected = [{"leased": "short"}, None, [3, 7], {"answer": LONG, "n": [1, 2]}, "", "é" * 256]
    for rank in (0, 1):
        got, votes = results[rank]
        assert got == expected, rank  # JSON's reading: a tuple comes back as a list
        assert votes == [(False, True, False), (True,), False]
