"""`transom check`: the pre-flight checks, run by hand on this machine.

    transom check [--json] [--checks compute,memory,...] [--device auto|cpu|cuda] [--timeout S]
                  [--checkpoint-uri URI] [--peer-url URL] [--nproc N] [--memory-mb N] [--run-index K]

One line per check (name, PASS / FAIL / SKIP, value, expected range, seconds) and a total;
with --json one JSON object {"checks": [...], "passed": bool, "seconds": total}. Exit 0 when
every check passed, contract.EXIT_PREFLIGHT_FAILED when one failed, 2 for a bad command
line. The coordinator's URL and token and the peer token come from the pod's environment
(contract.py) where set; faults of phase "preflight" from TRANSOM_FAULT. This
module imports no torch: the checks do, when they run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from transom import contract, defaults

MAX_MEMORY_MB = 1 << 20  # a TiB: a larger budget is a typo
# The memory check's default size: on the CPU it costs a loaded 2-core node seconds per
# 256 MiB (benchmarks/preflight.py), time a replacement waits; a GPU writes 1 GiB in ms.
CPU_MEMORY_MB, CUDA_MEMORY_MB = 64, 1024


def check_names(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated subset of contract.PREFLIGHT_CHECKS."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in contract.PREFLIGHT_CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown check {', '.join(map(repr, unknown)) or '(none given)'}: "
                                         f"the checks are {','.join(contract.PREFLIGHT_CHECKS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    from transom.arguments import between, seconds

    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.add_argument("--checks", type=check_names, default=contract.PREFLIGHT_CHECKS, metavar="NAME,...",
                   help=f"which checks (default all: {','.join(contract.PREFLIGHT_CHECKS)})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: the GPU forms (cuBLAS matmul, device memory, NCCL); auto (default): cuda where "
                        "torch sees a GPU, else cpu")
    p.add_argument("--timeout", type=seconds, default=defaults.PREFLIGHT_TIMEOUT_S,
                   help=f"seconds for all the checks together (default {defaults.PREFLIGHT_TIMEOUT_S:g})")
    p.add_argument("--checkpoint-uri",
                   help=f"the storage check's location (default ${contract.ENV_CHECKPOINT_URI}; unset: skipped)")
    p.add_argument("--peer-url", help="the link check's peer: a replica's state server, http://HOST:PORT (token: "
                                      f"${contract.ENV_PEER_TOKEN}; unset: skipped)")
    p.add_argument("--nproc", type=between(1, 1024), default=1,
                   help="local processes of the collective check (default 1: skipped)")
    p.add_argument("--memory-mb", type=between(0, MAX_MEMORY_MB), default=None,
                   help=f"MiB the memory check writes and reads back (default {CPU_MEMORY_MB} on the CPU, where "
                        f"it shares the cores with whatever else the node runs, {CUDA_MEMORY_MB} on a GPU)")
    p.add_argument("--run-index", type=between(0, 1 << 30), default=0,
                   help="which pre-flight of its launcher this is (0 the first; a waiting spare's count up): "
                        "where the injected faults of phase preflight fire")


def resolve_device(device: str) -> str:
    """`auto`: cuda where torch is there and sees a GPU, else cpu."""
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(args: argparse.Namespace) -> int:
    from transom import inject
    from transom.check import CheckContext, run_checks

    try:
        faults = inject.preflight_faults(os.environ)
    except ValueError as e:
        print(f"transom check: {contract.ENV_FAULT}: {e}", file=sys.stderr)
        return contract.EXIT_USAGE
    device = resolve_device(args.device)
    memory_mb = args.memory_mb if args.memory_mb is not None else CUDA_MEMORY_MB if device == "cuda" else CPU_MEMORY_MB
    context = CheckContext(
        device=device, nproc=args.nproc, memory_bytes=memory_mb << 20, faults=faults,
        run_index=args.run_index,
        checkpoint_uri=args.checkpoint_uri or os.environ.get(contract.ENV_CHECKPOINT_URI) or None,
        coordinator_url=os.environ.get(contract.ENV_COORDINATOR_URL) or None,
        token=os.environ.get(contract.ENV_COORDINATOR_TOKEN) or None,
        peer_url=args.peer_url, peer_token=os.environ.get(contract.ENV_PEER_TOKEN) or None)
    started = time.monotonic()
    results = run_checks(context, args.checks, args.timeout)
    total = time.monotonic() - started
    passed = all(r.passed for r in results)
    if args.json:
        print(json.dumps({"checks": [r.to_json() for r in results], "passed": passed, "seconds": round(total, 3)}))
    else:
        for r in results:
            verdict = "SKIP" if r.skipped else "PASS" if r.passed else "FAIL"
            value = "-" if r.value is None else f"{r.value:.4g}"
            print(f"{r.name:<11} {verdict:<4}  {value:>10}  expected {r.expected:<40} {r.seconds:7.3f} s")
            if not r.passed:
                print(f"            {r.message}")
        print(f"{'total':<11} {'PASS' if passed else 'FAIL':<4}  {len(results)} checks in {total:.3f} s")
    return contract.EXIT_OK if passed else contract.EXIT_PREFLIGHT_FAILED
