"""A small character-level GPT trained with Transom: the smallest complete training script.

    transom run --replicas 3 -- python examples/train_tiny_gpt.py --steps 60
    transom run --replicas 2 --nproc-per-replica 2 -- python examples/train_tiny_gpt.py --inner ddp
    transom run --replicas 2 --nproc-per-replica 2 -- python examples/train_tiny_gpt.py --inner fsdp
    transom run --replicas 3 --checkpoint-uri /tmp/ckpt -- python examples/train_tiny_gpt.py --checkpoint-interval 20

The text is generated (a seeded toy grammar), so the example needs no download. Each
replica reads its own shard of every step's batch (chosen by replica id and step, so a
repeated step sees the same data); with `--inner ddp` the replica's processes split that
shard further and average inside the replica with DDP (or shard the model with FSDP2,
and Transom averages each shard index across replicas), while Transom averages across
replicas and survives a replica's death. The loop is the usual one: AdamW, a learning rate
that warms up and then decays (a `LambdaLR`, stepped after committed steps, and replica
state: `extra_state`), and the gradients' norm clipped right after `backward()`, where they
are already the replicas' average (also under FSDP2). With a checkpoint URI, the run
checkpoints every `--checkpoint-interval` steps and at the end, and a new run of the same
job resumes from the newest checkpoint, bit for bit where the old one was: `transom run
--job-name NAME` with the name the first run printed (or was given), since a checkpoint
location belongs to one job (docs/checkpoint.md).
"""

from __future__ import annotations

import argparse
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from transom import ft

WORDS = (
    "the a one every some ship sail wind sea harbour captain crew rope deck mast storm calm "
    "north south light dark old new sails turns holds waits pulls rises falls under over near"
).split()


def make_corpus(num_sentences: int = 4000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        n = rng.randint(4, 9)
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)) + ".")
    return " ".join(out)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(data: torch.Tensor, step: int, shard: int, sub: int, num_sub: int, size: int, context: int):
    """The `sub`-th slice of replica `shard`'s batch of `step`: same inputs on every retry."""
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * shard + 17)
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=g)[sub::num_sub]
    x = torch.stack([data[s : s + context] for s in starts])
    y = torch.stack([data[s + 1 : s + context + 1] for s in starts])
    return x, y


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per replica")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["cpu", "ctx"], default="ctx",
                   help="where the model trains: ctx.device (this process's GPU where there is one, else the CPU), "
                        "or the CPU even where there is a GPU")
    p.add_argument("--inner", choices=["none", "ddp", "fsdp"], default="none", help="data parallelism inside a replica")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every this many steps")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="steps between checkpoints when a checkpoint URI is set (TRANSOM_CHECKPOINT_URI)")
    return p.parse_args()


def lr_factor(step: int, steps: int, warmup: int = 10) -> float:
    """A linear warmup over `warmup` steps, then a cosine decay to a tenth at `steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def build_model(args: argparse.Namespace, ctx: ft.ReplicaContext, vocab: int, device: torch.device) -> nn.Module:
    """The same weights on every replica, wrapped for the data parallelism inside a replica."""
    torch.manual_seed(0)  # every replica starts from the same weights
    gpt = TinyGPT(vocab, dim=args.dim, layers=args.layers, context=args.context).to(device)
    if args.inner == "fsdp" and ctx.world_size < 2:
        raise SystemExit("--inner fsdp needs --nproc-per-replica >= 2")
    if args.inner == "ddp":
        return nn.parallel.DistributedDataParallel(gpt, device_ids=[device.index] if device.type == "cuda" else None)
    if args.inner == "fsdp":  # FSDP2: each rank holds a shard; FTAR runs per shard index
        from torch.distributed.fsdp import fully_shard

        for block in gpt.blocks:
            fully_shard(block)
        fully_shard(gpt)
    return gpt


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    ctx = ft.init()
    text = make_corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    device = ctx.device if args.device == "ctx" else torch.device("cpu")
    model = build_model(args, ctx, len(chars), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.steps))
    # None without a checkpoint URI in the environment: then nothing is checkpointed.
    checkpoint = ft.CheckpointConfig.from_environ(interval_steps=args.checkpoint_interval)
    # The schedule's position is replica state: a restarted replica and a resumed job go on
    # with it, not from its start.
    trainer = ft.FaultTolerant(model, optimizer, ctx, checkpoint=checkpoint, extra_state=scheduler)
    if trainer.restored_step is not None and ctx.rank == 0:
        print(f"replica {trainer.replica_id}: resumed from the checkpoint of step {trainer.restored_step}", flush=True)

    loss = None
    try:
        for step in trainer.steps(args.steps):
            x, y = batch(data, step, trainer.replica_id, ctx.rank, ctx.world_size, args.batch_size, args.context)
            loss = model(x.to(device), y.to(device))
            loss.backward()  # the gradients come back averaged across replicas
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            if trainer.finish_step(loss):
                scheduler.step()  # the schedule follows committed steps only
            # Only committed steps this replica trained on the job's weights: no failed attempt
            # that runs again, no stale loss of a replica catching up.
            if ctx.rank == 0 and args.log_every and trainer.log_due(args.log_every):
                print(f"replica {trainer.replica_id}: step {trainer.step} loss {loss.item():.4f}", flush=True)
    finally:
        trainer.close()  # completes the job after the last step; before it, reports a failure
    if ctx.rank == 0 and trainer.final_batch_trained and loss is not None:
        print(f"replica {trainer.replica_id}: {trainer.step} steps, last loss {loss.item():.4f}", flush=True)
    if trainer.final_batch_trained:  # every rank: replicas that end bit-identical print one digest per rank
        print(f"replica {trainer.replica_id} rank {ctx.rank}: final step {trainer.step} parameters "
              f"{ft.state_digest(model)}", flush=True)


if __name__ == "__main__":
    main()
