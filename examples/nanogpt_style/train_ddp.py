"""nanoGPT's `train.py` in miniature, as it runs before Transom: DDP over torchrun's processes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/nanogpt_style/train_ddp.py
    python examples/nanogpt_style/train_ddp.py --max-iters 100      # one process, no DDP

The loop of Karpathy's nanoGPT: DDP from torchrun's environment, gradient accumulation with
DDP's `require_backward_grad_sync`, a GradScaler (enabled for float16 on a GPU, disabled on
the CPU), clipping, a cosine learning rate with warmup set by hand each iteration,
random-offset batches from a `np.memmap`, an evaluation every `eval_interval` iterations
at the top of the loop on the master process, which writes `ckpt.pt` when the validation
loss improves, and `--init-from resume` that reads it back. `train.py` beside it is this
script made fault tolerant; docs/training-api.md ("Porting a nanoGPT-style script") shows
the diff and the reasons. What this file adds to nanoGPT: the GradScaler's state in
`ckpt.pt`, a `ckpt.pt` at the end of the run (so a run stopped by `--max-iters` resumes
where it ended), and a file written atomically.
"""

import argparse
import math
import os
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from prepare import VOCAB, prepare

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out-dir", default="out-nanogpt-style", help="where ckpt.pt is written and read")
p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "transom-nanogpt-style"))
p.add_argument("--init-from", choices=["scratch", "resume"], default="scratch")
p.add_argument("--max-iters", type=int, default=300)
p.add_argument("--eval-interval", type=int, default=100)
p.add_argument("--eval-iters", type=int, default=10, help="batches per split in an evaluation")
p.add_argument("--log-interval", type=int, default=10)
p.add_argument("--gradient-accumulation-steps", type=int, default=2,
               help="micro steps per iteration, all ranks together")
p.add_argument("--batch-size", type=int, default=8, help="sequences per micro step")
p.add_argument("--block-size", type=int, default=64)
p.add_argument("--n-layer", type=int, default=2)
p.add_argument("--n-head", type=int, default=2)
p.add_argument("--n-embd", type=int, default=64)
p.add_argument("--learning-rate", type=float, default=3e-3)
p.add_argument("--warmup-iters", type=int, default=20)
p.add_argument("--lr-decay-iters", type=int, default=300, help="the schedule's length, independent of --max-iters")
p.add_argument("--min-lr", type=float, default=3e-4)
p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
               help="autocast type on a GPU (default float16, which uses the GradScaler); the CPU runs float32")
args = p.parse_args()
out_dir, data_dir, init_from, max_iters = args.out_dir, args.data_dir, args.init_from, args.max_iters
eval_interval, eval_iters, log_interval = args.eval_interval, args.eval_iters, args.log_interval
gradient_accumulation_steps, batch_size, block_size = args.gradient_accumulation_steps, args.batch_size, args.block_size
learning_rate, warmup_iters = args.learning_rate, args.warmup_iters
lr_decay_iters, min_lr = args.lr_decay_iters, args.min_lr
weight_decay, beta1, beta2, grad_clip, decay_lr = 0.1, 0.9, 0.99, 1.0, True

ddp = int(os.environ.get("RANK", -1)) != -1  # a torchrun run?
if ddp:
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", ddp_local_rank) if torch.cuda.is_available() else torch.device("cpu")
    master_process = ddp_rank == 0  # this process logs and writes checkpoints
    seed_offset = ddp_rank  # each process gets a different seed
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
prepare(data_dir)
torch.manual_seed(1337 + seed_offset)
device_type = device.type
if device_type == "cuda":
    torch.cuda.set_device(device)
dtype = (args.dtype or "float16") if device_type == "cuda" else "float32"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
amp_ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)


def get_batch(split, generator=None):
    # A new memmap per batch, as nanoGPT does (a long-lived one grows its memory).
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=block_size,
                  vocab_size=len(VOCAB))
checkpoint: Any = None  # torch.load's dict
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device, weights_only=True)
    model_args = checkpoint["model_args"]
model = GPT(GPTConfig(**model_args))
if init_from == "resume":
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
checkpoint = None  # free the memory
if ddp:  # nanoGPT's shape: one name for the model, wrapped or not
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)  # type: ignore[assignment]
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with amp_ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:  # linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 to 0
    return min_lr + coeff * (learning_rate - min_lr)


def save_checkpoint(iter_num, best_val_loss):
    # nanoGPT's plain format (torch.load(weights_only=True) reads it), plus the scaler's state;
    # a temp file renamed into place, so a reader never sees half a checkpoint.
    checkpoint = {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "model_args": model_args,
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
    }
    path = os.path.join(out_dir, "ckpt.pt")
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"saving checkpoint of iter {iter_num} to {out_dir}", flush=True)


X, Y = get_batch("train")  # the first batch
t0 = time.time()
while iter_num < max_iters:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            if iter_num > 0:
                save_checkpoint(iter_num, best_val_loss)

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # Only the last micro step all-reduces the gradients (DDP's no_sync, nanoGPT's way).
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with amp_ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # the sum over micro steps is the mean
        X, Y = get_batch("train")  # the next batch, fetched while the GPU works on this one
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.6f}, time {dt * 1000:.2f}ms", flush=True)
    iter_num += 1

if master_process:
    save_checkpoint(iter_num, best_val_loss)
if ddp:
    destroy_process_group()
