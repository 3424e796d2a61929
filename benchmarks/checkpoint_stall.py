"""What a checkpoint costs the training loop: torch.save vs DCP async_save vs Transom.

    .venv/bin/python benchmarks/checkpoint_stall.py --size-mb 1024 [--target file|s3] [--device cpu|cuda]

A state of `--size-mb` MiB (float32 tensors of 16 MiB, like a model's parameters and
optimizer moments) is checkpointed `--repeats` times by each method, into the same target:

(a) `torch.save` + fsync (file) or a streamed upload (s3): the loop waits for all of it.
(b) torch.distributed.checkpoint's `async_save` (no_dist): the loop waits for its staging copy.
(c) Transom: `engine.save()` + `wait_snapshot()` called at once, so no credit is taken for
    overlapping the copy with the next forward/backward (the conservative stall); the
    overlapped figure (a 0.5 s stand-in for the next step's compute before the wait) is
    printed beside it.

Also: Transom's persist throughput (bytes / time from save() to the manifest) against a
raw copy of the same bytes to the same target (one buffer, written and fsynced, or one
upload), and the restore time of the newest checkpoint (checksums verified; its files are
read as ranges on several connections at once) against raw reads of the same files: one
stream, and READ_STREAMS streams at once (the storage's aggregate throughput).

`--target s3` needs the testenv S3 server: `eval "$(hack/testenv.sh up)"` first (it exports
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and TRANSOM_S3_ENDPOINT). Prints readable lines and
ends with one JSON line. Targets: stall <= 0.1x (a) and <= (b); persist >= 80% of raw.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launcher"))

import fsspec  # noqa: E402
import torch  # noqa: E402

from _common import require_room  # noqa: E402
from transom import compat  # noqa: E402
from transom.checkpoint import layout  # noqa: E402
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine  # noqa: E402
from transom.checkpoint.restore import load_latest  # noqa: E402
from transom.checkpoint.storage import READ_PART_BYTES, READ_STREAMS, Storage  # noqa: E402

TENSOR_MB = 16


def make_state(size_mb: int, device: str) -> dict[str, torch.Tensor]:
    n = max(1, size_mb // TENSOR_MB)
    return {f"layer{i}.weight": torch.randn(TENSOR_MB * 1024 * 1024 // 4, device=device) for i in range(n)}


def sync_save(state, url: str) -> float:
    t0 = time.monotonic()
    if url.startswith("s3://"):
        with fsspec.open(url, "wb") as f:
            torch.save(state, f)
    else:
        with open(url, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    return time.monotonic() - t0


def dcp_async(state, url: str) -> tuple[float, float]:
    writer = compat.fsspec_writer(url, sync_files=True)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        future = compat.dcp_async_save(state, storage_writer=writer)
        stall = time.monotonic() - t0
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    return stall, time.monotonic() - t0


def raw_copy(nbytes: int, url: str) -> float:
    data = bytes(nbytes)  # one buffer of the same size: what the target can take at best
    t0 = time.monotonic()
    if url.startswith("s3://"):
        fs, path = fsspec.core.url_to_fs(url)
        fs.pipe_file(path, data)
    else:
        with open(url, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return time.monotonic() - t0


def raw_reads(uri: str, step: int) -> tuple[float, float]:
    """Seconds to read checkpoint `step`'s files without any check, the bytes thrown away: one
    file after another on one stream, and the same ranges as a restore (READ_PART_BYTES) on
    READ_STREAMS streams at once, each one a plain `cat_file` (the storage's aggregate speed
    through the same client; independent of `Storage.read_files`, which the restore uses)."""
    storage = Storage(uri)
    sizes = {f"{layout.step_dir(step)}/{k}": v for k, v in storage.sizes(layout.step_dir(step)).items()}
    t0 = time.monotonic()
    for path in sizes:
        storage.fs.cat_file(storage.path(path))
    one = time.monotonic() - t0
    ranges = [(storage.path(path), start, min(start + READ_PART_BYTES, size))
              for path, size in sizes.items() for start in range(0, size, READ_PART_BYTES)]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(READ_STREAMS) as pool:
        for _ in pool.map(lambda r: storage.fs.cat_file(r[0], start=r[1], end=r[2]), ranges):
            pass
    return one, time.monotonic() - t0


def restore_vs_raw(base: str, step: int, times: dict[str, list[float]]) -> None:
    """Restore and raw reads of the same checkpoint, in the order restore, raw, raw, restore
    (whatever drifts during the round, the server's own flushing after the write or another
    process's load, weighs on both alike); each one's mean, and the round's ratio."""
    restore, one, many = [], [], []
    for first in (True, False):
        for restoring in (first, not first):
            if restoring:
                t0 = time.monotonic()
                restored = load_latest(f"{base}/transom")
                restore.append(time.monotonic() - t0)
                assert restored.step == step
                del restored
            else:
                o, m = raw_reads(f"{base}/transom", step)
                one.append(o)
                many.append(m)
    times["restore"].append(statistics.mean(restore))
    times["read_one"].append(statistics.mean(one))
    times["read_many"].append(statistics.mean(many))
    times["restore_vs_raw"].append(times["read_many"][-1] / times["restore"][-1])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--target", choices=["file", "s3"], default="file")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="directory for --target file (default: a temp dir on local disk)")
    return p.parse_args()


def remove(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[str]:
    """The base URL every method writes under: a fresh S3 bucket, or a directory. On every
    path out, also an exception or Ctrl-C, nothing of the run stays behind."""
    if args.target == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("TRANSOM_S3_ENDPOINT")
        if not endpoint or not os.environ.get("AWS_ACCESS_KEY_ID"):
            sys.exit('--target s3 needs the testenv S3 server: eval "$(hack/testenv.sh up)" first')
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        bucket = f"bench-{secrets.token_hex(4)}"
        fs = fsspec.filesystem("s3")
        fs.mkdir(bucket)
        try:
            yield f"s3://{bucket}"
        finally:
            fs.rm(bucket, recursive=True)
        return
    local_dir = Path(args.dir or tempfile.mkdtemp(prefix="transom-ckpt-bench-"))
    local_dir.mkdir(parents=True, exist_ok=True)
    base = str(local_dir)
    try:
        yield base
    finally:
        if not args.dir:
            shutil.rmtree(local_dir, ignore_errors=True)
        else:
            for name in os.listdir(local_dir):
                if name in ("transom",) or name.startswith(("sync-", "dcp-", "raw-")):
                    remove(f"{base}/{name}")


def one_round(r: int, state: dict[str, torch.Tensor], nbytes: int, base: str, engine: CheckpointEngine,
              times: dict[str, list[float]]) -> None:
    """Round `r` of every method, each one's seconds appended to `times`."""
    times["sync"].append(sync_save(state, f"{base}/sync-{r}.pt"))
    remove(f"{base}/sync-{r}.pt")
    s, total = dcp_async(state, f"{base}/dcp-{r}")
    remove(f"{base}/dcp-{r}")
    times["dcp_stall"].append(s)
    times["dcp_total"].append(total)
    times["raw"].append(raw_copy(nbytes, f"{base}/raw-{r}.bin"))
    remove(f"{base}/raw-{r}.bin")

    t0 = time.monotonic()
    assert engine.save(2 * r + 1, state)
    engine.wait_snapshot()
    times["tr_stall"].append(time.monotonic() - t0)
    assert engine.wait_persisted(1800)
    times["tr_persist"].append(engine.last_persist_s + times["tr_stall"][-1])

    t0 = time.monotonic()
    assert engine.save(2 * r + 2, state)
    blocked = time.monotonic() - t0
    time.sleep(0.5)  # the next step's forward/backward, during which the copy runs
    t1 = time.monotonic()
    engine.wait_snapshot()
    times["tr_overlap"].append(blocked + time.monotonic() - t1)
    assert engine.wait_persisted(1800)

    restore_vs_raw(base, 2 * r + 2, times)


def summarize(args: argparse.Namespace, nbytes: int, times: dict[str, list[float]]) -> dict:
    med = statistics.median
    gib = nbytes / 2**30
    result = {
        "benchmark": "checkpoint_stall", "size_mb": round(nbytes / 2**20), "target": args.target,
        "device": args.device, "repeats": args.repeats,
        "sync_stall_s": round(med(times["sync"]), 3), "dcp_async_stall_s": round(med(times["dcp_stall"]), 3),
        "dcp_async_total_s": round(med(times["dcp_total"]), 3), "transom_stall_s": round(med(times["tr_stall"]), 3),
        "transom_stall_overlapped_s": round(med(times["tr_overlap"]), 3),
        "transom_persist_gib_s": round(gib / med(times["tr_persist"]), 3),
        "raw_copy_gib_s": round(gib / med(times["raw"]), 3),
        "restore_s": round(med(times["restore"]), 3),
        "restore_gib_s": round(gib / med(times["restore"]), 3),
        "raw_read_one_stream_gib_s": round(gib / med(times["read_one"]), 3),
        "raw_read_aggregate_gib_s": round(gib / med(times["read_many"]), 3),
    }
    best = max(result["raw_read_one_stream_gib_s"], result["raw_read_aggregate_gib_s"])
    result["restore_vs_best_raw_read"] = round(result["restore_gib_s"] / best, 3)
    q = statistics.quantiles(times["restore_vs_raw"], n=4) if len(times["restore_vs_raw"]) > 1 else [0.0] * 3
    result["restore_vs_raw"] = round(med(times["restore_vs_raw"]), 3)  # per round, vs the aggregate read
    result["restore_vs_raw_p25_p75"] = [round(q[0], 3), round(q[2], 3)]
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    result["ratio_vs_sync"] = round(result["transom_stall_s"] / result["sync_stall_s"], 3)
    result["ratio_vs_dcp"] = round(result["transom_stall_s"] / max(result["dcp_async_stall_s"], 1e-9), 3)
    result["persist_vs_raw"] = round(result["transom_persist_gib_s"] / result["raw_copy_gib_s"], 3)
    result["ok"] = (result["ratio_vs_sync"] <= 0.1 and result["ratio_vs_dcp"] <= 1.0
                    and result["persist_vs_raw"] >= 0.8)
    return result


def report(args: argparse.Namespace, result: dict) -> None:
    print(f"state {result['size_mb']} MiB on {args.device}, target {args.target}, median of {args.repeats}:")
    print(f"stall: torch.save+fsync {result['sync_stall_s']:.3f}s, dcp.async_save {result['dcp_async_stall_s']:.3f}s "
          f"(done after {result['dcp_async_total_s']:.3f}s), transom {result['transom_stall_s']:.3f}s "
          f"({result['transom_stall_overlapped_s']:.3f}s overlapped with 0.5s of compute)")
    print(f"ratios: transom/sync {result['ratio_vs_sync']:.3f} (target <= 0.1), transom/dcp "
          f"{result['ratio_vs_dcp']:.3f} (target <= 1)")
    print(f"persist: transom {result['transom_persist_gib_s']:.3f} GiB/s, raw copy {result['raw_copy_gib_s']:.3f} "
          f"GiB/s, ratio {result['persist_vs_raw']:.3f} (target >= 0.8)")
    print(f"restore: {result['restore_s']:.3f}s, {result['restore_gib_s']:.3f} GiB/s (checksums verified); the "
          f"same files raw: one stream {result['raw_read_one_stream_gib_s']:.3f} GiB/s, {READ_STREAMS} streams "
          f"{result['raw_read_aggregate_gib_s']:.3f} GiB/s; restore/best raw {result['restore_vs_best_raw_read']:.3f}")
    print(f"restore_vs_raw (per round, restore vs the {READ_STREAMS}-stream raw read): median "
          f"{result['restore_vs_raw']:.3f}, "
          f"p25-p75 {result['restore_vs_raw_p25_p75'][0]:.3f}-{result['restore_vs_raw_p25_p75'][1]:.3f} "
          f"(target >= 0.8); load average {result['loadavg']}")
    print(json.dumps(result))


def main() -> int:
    args = parse_args()
    # At most three copies of the state on storage at once (Transom keeps two checkpoints,
    # plus the file of the method being measured; each is deleted once measured), and in
    # host memory the state (on the CPU), Transom's snapshot, DCP's staging copy and a restore.
    size = args.size_mb * 2**20
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    require_room(disk_path=None if args.target == "s3" else (args.dir or tempfile.gettempdir()),
                 disk_bytes=int(3.2 * size), memory_bytes=(4 if args.device == "cpu" else 3) * size + 2**30,
                 what=f"checkpoint_stall --size-mb {args.size_mb}")
    state = make_state(args.size_mb, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {k: [] for k in (
        "sync", "dcp_stall", "dcp_total", "tr_stall", "tr_overlap", "tr_persist", "raw", "restore", "read_one",
        "read_many", "restore_vs_raw")}
    with target(args) as base:
        engine = CheckpointEngine(CheckpointConfig(uri=f"{base}/transom", keep=2))
        try:
            for r in range(args.repeats):
                one_round(r, state, nbytes, base, engine, times)
        finally:
            engine.close()
    report(args, summarize(args, nbytes, times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
