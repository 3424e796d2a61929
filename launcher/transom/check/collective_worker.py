"""One rank of the collective check: `python -m transom.check.collective_worker --rank R
--world N --port P --device cpu|cuda --bytes B --timeout S`.

It joins a process group of N local ranks (Gloo on the CPU, NCCL on GPU R) through a
TCPStore on 127.0.0.1:P (rank 0 serves it), all-reduces (sums) a float32 tensor of B bytes
filled with R + 1 ITERATIONS times, checks that every element of each sum is N(N + 1)/2,
and prints one JSON line: {"rank", "bad_elements", "seconds", "bus_gbps"}, where seconds is
the fastest all-reduce and bus_gbps its bus bandwidth (nccl-tests' busbw: the bytes each
rank's link carries in a ring, 2(N - 1)/N of the tensor, per second). The parent
(collective.py) reads the lines as JSON, kills the ranks when its time is spent, and exits
with the check's answer; a rank that fails exits non-zero with the error on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

ITERATIONS = 3  # timed all-reduces after the first (which connects, and is not timed)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m transom.check.collective_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
    device = torch.device("cuda", args.rank) if args.device == "cuda" else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=args.rank == 0, timeout=timeout)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store, rank=args.rank,
                            world_size=args.world, timeout=timeout)
    try:
        tensor = torch.empty(max(1, args.bytes // 4), dtype=torch.float32, device=device)
        total = args.world * (args.world + 1) / 2
        bad, best = 0, float("inf")
        for i in range(ITERATIONS + 1):
            tensor.fill_(args.rank + 1)
            _synchronize(torch, device)
            started = time.perf_counter()
            dist.all_reduce(tensor)
            _synchronize(torch, device)
            if i > 0:
                best = min(best, time.perf_counter() - started)
            bad += int((tensor != total).sum().item())
    finally:
        dist.destroy_process_group()
    bus_gbps = tensor.numel() * 4 * 2 * (args.world - 1) / args.world / best / 1e9
    print(json.dumps({"rank": args.rank, "bad_elements": bad, "seconds": best, "bus_gbps": bus_gbps}), flush=True)
    return 0


def _synchronize(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
