"""What a checkpoint costs the training loop: torch.save vs DCP async_save vs Transom.

    .venv/bin/python benchmarks/checkpoint_stall.py --size-mb 1024 [--target file|s3] [--device cpu|cuda]
    .venv/bin/python benchmarks/checkpoint_stall.py --training [--rounds 7] [--every 3] [--device cpu|cuda]

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
stream, and the restore's ranges on READ_STREAMS streams at once, plain `cat_file`s (the
storage's aggregate throughput). Restores and raw reads alternate within each round;
`restore_vs_raw` is the median over rounds of each round's ratio (target >= 0.8).

`--training`: the stall of a save while training runs. workload.py's `mlp` (25.2 M
parameters; with AdamW's moments a 300 MB state) trains in each of its two shapes
(`cpu_bound`, and `accelerator_shaped`: one-row batches and per-module waits that release
the CPU, calibrated here), and is checkpointed every `--every` steps by (1) Transom as the
trainer does it (`save` at the step boundary, the snapshot overlapping the next
forward/backward, `wait_snapshot` before the next optimizer step) and (2) `dcp.async_save`
with background staging into kept buffers, waited for at the same point (on CUDA: staging
into a kept pinned copy before it returns; DcpSaver says why). The stall of a save is the
extra time of the two steps around it (the one that saves and the next) over the median
step before the segment's first save; each method's
figure is the median over its saves. The methods alternate over `--rounds` rounds; the
figures are the median and p25-p75 of the per-round ratios Transom / DCP, with the load
average. Printed per shape; the last line is one JSON object keyed by shape.

`--target s3` needs an S3 server: the testenv's (`eval "$(hack/testenv.sh up)"`, which
exports AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and TRANSOM_S3_ENDPOINT), or SeaweedFS's
`weed mini` started by hand with the same flags (hack/testenv/cluster.py `_start_s3`) and
those variables set. Prints readable lines and ends with one JSON line. Targets: stall <=
0.1x (a) and <= (b); persist >= 80% of raw; restore >= 80% of the aggregate raw read.
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
from typing import Any

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
    """Restores and raw reads of the same checkpoint, three of each, interleaved (restore, raw,
    raw, restore, restore, raw: whatever drifts during the round, the server's flushing after
    the write or another process's load, weighs on both alike); each one's median, and the
    round's ratio of the two."""
    restore, one, many = [], [], []
    for restoring in (True, False, False, True, True, False):
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
    times["restore"].append(statistics.median(restore))
    times["read_one"].append(statistics.median(one))
    times["read_many"].append(statistics.median(many))
    times["restore_vs_raw"].append(times["read_many"][-1] / times["restore"][-1])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--target", choices=["file", "s3"], default="file")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="directory for --target file (default: a temp dir on local disk)")
    p.add_argument("--training", action="store_true",
                   help="the stall of a save while workload.py's mlp trains, per shape, Transom vs dcp.async_save")
    p.add_argument("--rounds", type=int, default=7, help="--training: rounds, the methods alternating")
    p.add_argument("--every", type=int, default=4, help="--training: steps from one save to the next (>= 2)")
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


# --- the stall of a checkpoint while training runs (--training) ---------------------------------

class TransomSaver:
    """Transom as the trainer uses it: `save` after the optimizer step (the snapshot starts and
    overlaps the next forward/backward), `wait_snapshot` before the next optimizer step."""

    name = "transom"

    def __init__(self, base: str) -> None:
        self.engine = CheckpointEngine(CheckpointConfig(uri=f"{base}/transom-train", keep=2))

    def save(self, step: int, state: dict) -> None:
        assert self.engine.save(step, state)

    def before_optimizer(self) -> None:
        self.engine.wait_snapshot()

    def drain(self) -> None:
        assert self.engine.wait_persisted(1800)

    def close(self) -> None:
        self.engine.close()


class DcpSaver:
    """`dcp.async_save` (no_dist) at its best: on the CPU a DefaultStager that stages in the
    background into buffers it keeps from one save to the next, waited for before the next
    optimizer step, as Transom's snapshot is; on CUDA a BlockingAsyncStager that keeps its
    pinned copy (staging before async_save returns). Without either (older torch) the plain
    async_save, which stages before it returns."""

    name = "dcp"

    def __init__(self, base: str, cuda: bool) -> None:
        self.base, self.saves, self.response = base, 0, None
        self.stager: Any = None
        if cuda:
            # DefaultStager's deep copy into pinned memory failed on torch 2.11 (`KeyError:
            # <class 'type'>`, its copier table empty): the blocking stager that keeps its
            # pinned copy from one save to the next, the staging waited for in save().
            from torch.distributed.checkpoint.staging import BlockingAsyncStager
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
            return
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))

    def save(self, step: int, state: dict) -> None:
        self.saves += 1
        writer = compat.fsspec_writer(f"{self.base}/dcp-train-{self.saves}", sync_files=True)
        extra = {"async_stager": self.stager} if self.stager is not None else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.response = compat.dcp_async_save(state, storage_writer=writer, **extra)

    def before_optimizer(self) -> None:
        if self.response is not None and hasattr(self.response, "staging_completion"):
            self.response.staging_completion.result()

    def drain(self) -> None:
        if self.response is not None:
            response, self.response = self.response, None
            (response.upload_completion if hasattr(response, "upload_completion") else response).result()
            remove(f"{self.base}/dcp-train-{self.saves}")  # on storage only while it is measured

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


class Trainer:
    """workload.py's `mlp` model in one shape, trained step by step with a saver's hooks."""

    def __init__(self, shape: str) -> None:
        import workload

        env = workload.shape_env(shape, "mlp")  # the accelerator-shaped waits, calibrated here
        waits = (float(env.get("BENCH_WAIT_FWD_S", 0)), float(env.get("BENCH_WAIT_BWD_S", 0)))
        self.work = workload.Workload("mlp", shape, waits)
        self.opt = self.work.optimizer()
        self.cuda = self.work.device.type == "cuda"
        self.step_no = 0
        self.plain_s: list[float] = []  # each segment's median step before its first save

    def step(self, saver: TransomSaver | DcpSaver, save: bool = False) -> float:
        """One training step's seconds: forward, backward, the saver's wait, the optimizer step,
        and with `save` the checkpoint of the state after it (the step boundary)."""
        t0 = time.perf_counter()
        self.work.loss(0, self.step_no).backward()
        saver.before_optimizer()  # the snapshot (staging) of the last save must be complete
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        if save:
            saver.save(self.step_no, {"model": self.work.model.state_dict(), "optimizer": self.opt.state_dict()})
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def stall_segment(trainer: Trainer, saver: TransomSaver | DcpSaver, saves: int, every: int) -> float:
    """The median over `saves` checkpoints of the extra time of the two steps around each one
    (the step that saves and the next, during which the snapshot or staging completes),
    against the median of this segment's steps before the first save. Before each save the
    previous checkpoint is waited out, untimed, so none is skipped or overlaps another."""
    plain = [trainer.step(saver) for _ in range(5)]
    base = statistics.median(plain[1:])  # the first step after the other method's segment warms up
    trainer.plain_s.append(base)
    stalls = []
    for _ in range(saves):
        saver.drain()
        around = trainer.step(saver, save=True) + trainer.step(saver)
        stalls.append(around - 2 * base)
        for _ in range(every - 2):
            trainer.step(saver)
    saver.drain()
    return statistics.median(stalls)


def training_shape(shape: str, base: str, rounds: int, every: int) -> dict:
    """Both methods' stalls in `shape`, alternating which goes first, over `rounds` rounds."""
    trainer = Trainer(shape)
    savers: list[TransomSaver | DcpSaver] = [TransomSaver(base), DcpSaver(base, trainer.cuda)]
    stalls: dict[str, list[float]] = {"transom": [], "dcp": []}
    try:
        for _ in range(3):  # warm-up: the allocator, the optimizer's state
            trainer.step(savers[0])
        for r in range(rounds):
            for saver in savers if r % 2 == 0 else savers[::-1]:
                stalls[saver.name].append(stall_segment(trainer, saver, saves=2, every=every))
    finally:
        for saver in savers:
            saver.close()
    # A stall at or below zero is noise around a step's own time: 1 ms floors the denominator.
    ratios = [t / max(d, 1e-3) for t, d in zip(stalls["transom"], stalls["dcp"])]
    medians = {name: statistics.median(values) for name, values in stalls.items()}
    q = statistics.quantiles(ratios, n=4)
    return {"step_s": round(statistics.median(trainer.plain_s), 4), "transom_stall_s": round(medians["transom"], 4),
            "dcp_async_stall_s": round(medians["dcp"], 4),
            "ratio_transom_vs_dcp": round(statistics.median(ratios), 3),
            "ratio_of_medians": round(medians["transom"] / max(medians["dcp"], 1e-3), 3),
            "ratio_p25_p75": [round(q[0], 3), round(q[2], 3)], "rounds": rounds,
            "transom_stalls_s": [round(x, 4) for x in stalls["transom"]],
            "dcp_stalls_s": [round(x, 4) for x in stalls["dcp"]]}


def training_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))
    os.environ["BENCH_DEVICE"] = args.device  # workload.py puts the model where this says
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))  # as workload.py's workers
    warnings.filterwarnings("ignore", category=UserWarning)  # DCP's "no process group", from its threads too
    result: dict = {"benchmark": "checkpoint_stall", "mode": "training", "model": "mlp", "target": args.target,
                    "device": args.device, "every": args.every}
    with target(args) as base:
        for shape in ("cpu_bound", "accelerator_shaped"):
            r = result[shape] = training_shape(shape, base, args.rounds, args.every)
            print(f"{shape}: step {r['step_s']:.3f}s; stall around a save (median of {args.rounds} rounds): "
                  f"transom {r['transom_stall_s']:.4f}s, dcp.async_save {r['dcp_async_stall_s']:.4f}s; "
                  f"transom/dcp per round: median {r['ratio_transom_vs_dcp']:.3f}, "
                  f"p25-p75 {r['ratio_p25_p75'][0]:.3f}-{r['ratio_p25_p75'][1]:.3f}; ratio of the medians "
                  f"{r['ratio_of_medians']:.3f}", flush=True)
    result["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average {result['loadavg']}")
    print(json.dumps(result))
    return 0


def main() -> int:
    args = parse_args()
    if args.training:
        return training_main(args)
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
