"""ft/inner_reduction.py on real DDP and FSDP2 worlds of two processes (Gloo): which way the
exchange is attached to each kind of model, and what each hands over mid-backward.

- DDP: the hook takes the step's quorum (`open_step`) once, in DDP's first bucket, on
  every rank; every one of Transom's buckets is handed over once, in order, with the
  gradients DDP then writes into `.grad`: as DDP averaged them inside the replica, or,
  where the exchange reduces inside the replica too (wide, or in slices), the rank's own
  (DDP reduces nothing); outside an exchanging pass DDP still reduces and nothing is
  handed over.
- FSDP2: one reduce-scattered shard per FSDP group and pass; a shard changed in the hook is
  what the sharded gradient is made of. A model with a parameter outside FSDP2 falls back
  to the exchange at the end of the pass.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.timeout(120)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)


def _ddp_worker(rank: int, port: int, out: mp.Queue, how: str | None) -> None:
    from transom.ft import inner_reduction
    from transom.ft.backward import GradientsReady
    from transom.ft.ftar import bucket_params

    _init(rank, port)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.02)  # several DDP buckets
    buckets = bucket_params(list(reversed(list(ddp.parameters()))), 10_000)  # one per layer
    active, opened, ended = [True], [], []
    handed: list[tuple[int, list[torch.Tensor]]] = []
    ready = GradientsReady(ddp, lambda: ended.append(len(handed)), lambda: active[0])

    def on_bucket(i: int) -> None:  # what the exchange would send, as it is when handed over
        handed.append((i, [g.clone() for g in ready.final_grads(i) or []]))

    mode = inner_reduction.attach(ddp, ready, buckets, on_bucket, lambda shard: None,
                                  lambda: opened.append(len(handed)), how)
    results = []
    for step in range(3):
        active[0] = step != 1  # step 1: a pass outside the exchange (DDP still reduces)
        ready.reset()
        handed.clear()
        opened.clear()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank * 100 + step))
        ddp(x).square().mean().backward()
        kept = all(p.grad is not None and torch.equal(g, p.grad)
                   for i, grads in handed for p, g in zip(buckets[i], grads, strict=True))
        mine = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])  # type: ignore[union-attr]
        theirs = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(theirs, mine)
        results.append(([i for i, _ in handed], kept, opened[:1], len(opened) > 0, torch.equal(*theirs)))
        ddp.zero_grad()
    out.put((rank, mode, len(buckets), results))
    dist.destroy_process_group()


def _fsdp_worker(rank: int, port: int, out: mp.Queue) -> None:
    from torch.distributed.fsdp import fully_shard

    from transom.ft import inner_reduction
    from transom.ft.backward import GradientsReady

    _init(rank, port)
    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    shards: list[int] = []

    def on_shard(shard: torch.Tensor) -> None:
        shards.append(shard.numel())
        shard.fill_(7.0)  # what the exchange writes is what the sharded gradients are made of

    ready = GradientsReady(model, lambda: None, lambda: True)
    mode = inner_reduction.attach(model, ready, [], lambda i: None, on_shard, lambda: None, None)
    model(torch.randn(8, 64)).square().mean().backward()
    # The shard as the hook left it (FSDP2 divided it by the ranks before: nothing after).
    filled = {v for p in model.parameters() for v in p.grad.to_local().unique().tolist()}  # type: ignore[union-attr]
    mixed = torch.nn.Sequential(_model(), torch.nn.Linear(64, 1))  # the head is not under FSDP2
    fully_shard(mixed[0])
    mixed_mode = inner_reduction.attach(mixed, GradientsReady(mixed, lambda: None, lambda: True), [],
                                        lambda i: None, on_shard, lambda: None, None)
    out.put((rank, mode, len(shards), filled, mixed_mode))
    dist.destroy_process_group()


def _run(target, *extra) -> list:
    store_port = _free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store_port, out, *extra)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return sorted(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("how", [None, "wide"])
def test_under_ddp_each_bucket_is_handed_over_once_in_order(how):
    for rank, mode, n, results in _run(_ddp_worker, how):
        assert mode == (f"ddp {how}" if how else "ddp") and n >= 3, (rank, mode, n)
        for step, (order, kept, first_open, opened, alike) in enumerate(results):
            if step == 1:  # outside an exchanging pass: nothing handed over, no quorum taken, DDP reduces
                assert order == [] and not opened and alike
                continue
            assert order == list(range(n)), (step, order)
            assert kept, f"step {step}: what was handed over is not what DDP left in .grad"
            # DDP reducing: handed over once DDP averaged them. Wide or in slices: the rank's
            # own gradients, which the exchange reduces inside the replica itself.
            assert alike is (how is None), f"step {step}: DDP {'reduced' if alike else 'did not reduce'}"
            assert first_open == [0], "the quorum is taken before any bucket is handed over"


def test_under_fsdp2_each_group_hands_over_its_shard_and_a_mixed_model_waits_for_the_end():
    for _rank, mode, shards, filled, mixed_mode in _run(_fsdp_worker):
        assert mode == "fsdp"
        assert shards == 4, "one shard per FSDP group that holds parameters (the 4 layers; the root holds none)"
        assert filled == {7.0}, "the sharded gradients are made of the shard the hook wrote"
        assert mixed_mode == "end"
