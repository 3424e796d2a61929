"""A loop whose batches are drawn from a generator seeded the way a first port often seeds it.

    transom run --replicas 2 -- python seeded_batches.py --steps 8 --seed-by rank

`--seed-by rank`: by the rank alone, as nanoGPT's `seed_offset = ddp_rank` does. Every
replica is a world of its own with ranks 0..world_size-1, so rank k of every replica draws the
same batches: the job trains on one replica's data (the coordinator's DuplicateData finding).
`--seed-by replica-rank`: by the replica and the rank, distinct everywhere. `--indices`: the
model's input is not the data; the script names the sample indices with
`trainer.fingerprint_input` instead.
"""

from __future__ import annotations

import argparse

import torch

from transom import ft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed-by", choices=["rank", "replica-rank"], required=True)
    p.add_argument("--indices", action="store_true", help="name the sample indices with trainer.fingerprint_input")
    args = p.parse_args()
    ctx = ft.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.randn(4096, 4, generator=torch.Generator().manual_seed(1))
    with ft.FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.01), ctx) as trainer:
        offset = ctx.rank if args.seed_by == "rank" else trainer.replica_id * ctx.world_size + ctx.rank
        for step in trainer.steps(args.steps):
            g = torch.Generator().manual_seed(1000 * step + offset)
            indices = torch.randint(len(data), (16,), generator=g)
            if args.indices:
                trainer.fingerprint_input(indices.tolist())
                x = torch.ones(16, 4)  # the model's first argument says nothing about the data
                loss = (model(x).squeeze(1) - data[indices, 0]).pow(2).mean()
            else:
                loss = model(data[indices]).pow(2).mean()
            loss.backward()
            trainer.finish_step(loss)


if __name__ == "__main__":
    main()
