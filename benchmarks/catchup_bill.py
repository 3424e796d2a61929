"""The catch-up's CPU bill: what each piece of a replica's catch-up costs, per MB of state.

    .venv/bin/python benchmarks/catchup_bill.py [--sources 2] [--repeats 3] [--base REV [--pairs 2]]

Purpose: issue 32 asks that a replica's catch-up after a rejoin costs the healthy replicas
at most 5% of a step. This measures where the CPU goes, piece by piece, with the code the
trainer runs (ft/catchup.py, ft/transfer.py, ft/state_server.py, checkpoint/snapshot.py),
not a reimplementation, on the state of benchmarks/scripts/workload.py's `mlp` (6 x
Linear(2048, 2048) and AdamW's moments after one step: 25.2 M parameters, ~300 MB).

Figures, each the median of `--repeats`, as CPU seconds of this process (user + system,
every thread of the piece) and wall seconds, and CPU milliseconds per MB of state:

- on a source: `copy` (checkpoint/snapshot.py's host copy, a fresh Snapshot as
  `Source.after_commit` makes one), `publish` (transfer.publish: the manifest and the
  digest of every chunk), `serve` (the state servers' connection threads answering every
  chunk over loopback HTTP: the handler's own thread CPU, all `--sources` together);
- on the joiner: `fetch` (transfer.fetch's workers: receiving every chunk into the
  buffer and checking it), `shadow` (transfer.assemble + catchup.Shadow), `replay` (one
  recorded step, catchup.Shadow.replay: per step), `swap` (Shadow.swap_into);
- the wire checksum alone: zlib.crc32 against google_crc32c over the same 4 MiB chunks;
- a training step of the same model (forward, backward, AdamW) for scale.

The replayed shadow is checked bit for bit against a replica that stepped normally.
Wall times on a shared 2-core box are noisy: the load average is printed beside them.
`--base REV` runs the same measurement on REV's library too (benchmarks/_base.py), each
version in a process of its own, alternating `--pairs` times, and prints the medians side by
side with their ratio (checkout / base). Prints readable lines and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "CATCHUP_BILL_LAUNCHER"  # set by --base: the launcher/ to measure, else the checkout's
sys.path.insert(0, os.environ.get(LIBRARY) or str(ROOT / "launcher"))

import torch  # noqa: E402

from transom.checkpoint import structure  # noqa: E402
from transom.checkpoint.snapshot import Snapshot  # noqa: E402
from transom.ft import catchup, state_server, transfer  # noqa: E402

DIM, LAYERS, BATCH = 2048, 6, 32  # benchmarks/scripts/workload.py's mlp
TOKEN = "bench"


class ThreadCpu:
    """CPU seconds spent inside `fn` by whichever threads call it (thread_time around each call)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.thread_time() - t0
        return timed

    def take(self) -> float:
        with self._lock:
            s, self.seconds = self.seconds, 0.0
        return s


def measure(fn: Callable, *args: Any) -> tuple[Any, float, float]:
    """(fn(*args), process CPU seconds, wall seconds)."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.process_time() - c0, time.perf_counter() - w0


def make_replica(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def backward(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    model(torch.randn(BATCH, DIM, generator=g)).square().mean().backward()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    backward(model, step)
    opt.step()
    opt.zero_grad(set_to_none=True)


def source_pieces(tensors: dict[str, torch.Tensor], skeleton: Any,
                  repeats: int) -> tuple[transfer.Published, dict[str, list[tuple[float, float]]]]:
    """The copy and the publish, `repeats` times each, as a source makes them."""
    runs: dict[str, list[tuple[float, float]]] = {"copy": [], "publish": []}
    published = None
    for _ in range(repeats):
        # Source.after_commit takes a new Snapshot per snapshot
        host, cpu, wall = measure(lambda snap: (snap.start(tensors), snap.wait())[1], Snapshot())
        runs["copy"].append((cpu, wall))
        published, cpu, wall = measure(transfer.publish, 1, host, skeleton)
        runs["publish"].append((cpu, wall))
    assert published is not None
    return published, runs


def fetch_pieces(published: transfer.Published, n_sources: int,
                 repeats: int) -> tuple[bytearray, dict[str, list[tuple[float, float]]]]:
    """Every chunk fetched from `n_sources` real state servers over loopback, `repeats` times."""
    serve_cpu, fetch_cpu = ThreadCpu(), ThreadCpu()
    # The joiner's per-chunk function: _Link.chunk_into, or before keep-alive _chunk_into (--base)
    owner, name = (transfer._Link, "chunk_into") if hasattr(transfer, "_Link") else (transfer, "_chunk_into")
    handle, chunk_into = state_server._Handler.handle, getattr(owner, name)
    state_server._Handler.handle = serve_cpu.wrap(handle)  # type: ignore[method-assign]
    setattr(owner, name, fetch_cpu.wrap(chunk_into))
    servers = [state_server.StateServer(TOKEN) for _ in range(n_sources)]
    runs: dict[str, list[tuple[float, float]]] = {"serve": [], "fetch": []}
    data = bytearray()
    try:
        for s in servers:
            s.publish_snapshot(published)
        manifest = transfer.parse_manifest(published.manifest_json)
        for _ in range(repeats):
            serve_cpu.take(), fetch_cpu.take()
            data, _, wall = measure(lambda: transfer.fetch(manifest, [s.url for s in servers], TOKEN, 60.0))
            runs["serve"].append((serve_cpu.take(), wall))
            runs["fetch"].append((fetch_cpu.take(), wall))
    finally:
        state_server._Handler.handle = handle  # type: ignore[method-assign]
        setattr(owner, name, chunk_into)
        for s in servers:
            s.close()
    return data, runs


def checksums(published: transfer.Published, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """The wire checksum alone, each algorithm over the same chunks (their pieces, no copy)."""
    import google_crc32c
    import numpy as np

    def crc32c(pieces: list[memoryview]) -> int:
        v = 0
        for p in pieces:  # an ndarray over the view: google_crc32c takes it without a copy
            v = google_crc32c.extend(v, np.frombuffer(p, np.uint8))
        return v

    def crc32(pieces: list[memoryview]) -> int:
        v = 0
        for p in pieces:
            v = zlib.crc32(p, v)
        return v

    chunks = range(len(published.manifest.digests))
    runs: dict[str, list[tuple[float, float]]] = {"zlib.crc32": [], "google_crc32c": []}
    for _ in range(repeats):
        for name, fn in (("zlib.crc32", crc32), ("google_crc32c", crc32c)):
            _, cpu, wall = measure(lambda f: [f(published.chunk(i)) for i in chunks], fn)
            runs[name].append((cpu, wall))
    return runs


def joiner_pieces(data: bytearray, manifest: transfer.SnapshotManifest,
                  src: tuple[torch.nn.Module, torch.optim.Optimizer],
                  repeats: int) -> tuple[dict[str, list[tuple[float, float]]], bool]:
    """Shadow, replay of `repeats` recorded steps (the source steps the same), swap; and
    whether the joiner ends bit-identical to the source."""
    model, opt = src
    runs: dict[str, list[tuple[float, float]]] = {"shadow": [], "replay": [], "swap": []}
    shadow = None
    for _ in range(repeats):  # the shadow's build is repeated; the last one is replayed on
        j_model, j_opt = make_replica(seed=1)
        train_step(j_model, j_opt, 0)  # the joiner's own optimizer has state, as after its restart
        shadow, cpu, wall = measure(
            lambda m, o: catchup.Shadow(transfer.assemble(manifest, data), *catchup.parameters_of(m), o),
            j_model, j_opt)
        runs["shadow"].append((cpu, wall))
    assert shadow is not None
    for k in range(repeats):
        backward(model, 10 + k)
        record = catchup.record_of(shadow.step, opt, update=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _, cpu, wall = measure(shadow.replay, record)
        runs["replay"].append((cpu, wall))
    _, cpu, wall = measure(shadow.swap_into, j_model, j_opt)
    runs["swap"].append((cpu, wall))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), j_model.parameters()))
    for a, b in zip(opt.state.values(), j_opt.state.values()):
        same = same and all(torch.equal(a[k], b[k]) for k in a)
    return runs, same


def report(runs: dict[str, list[tuple[float, float]]], mb: float, where: dict[str, str]) -> dict[str, dict]:
    out = {}
    for name, rs in runs.items():
        cpu, wall = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        out[name] = {"cpu_s": round(cpu, 4), "wall_s": round(wall, 4), "cpu_ms_per_mb": round(1e3 * cpu / mb, 3)}
        print(f"  {where.get(name, ''):8} {name:14} cpu {cpu:7.3f} s  wall {wall:7.3f} s  "
              f"{1e3 * cpu / mb:7.3f} ms CPU/MB")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", type=int, default=2, help="state servers the joiner fetches from")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--base", metavar="REV", help="also measure REV's library, alternating with the checkout's")
    p.add_argument("--pairs", type=int, default=2, help="with --base: runs of each version")
    args = p.parse_args()
    if args.base:
        return against_base(args)
    load0 = os.getloadavg()
    model, opt = make_replica()
    train_step(model, opt, 0)
    _, step_cpu, step_wall = measure(train_step, model, opt, 1)
    state = {"step": 2, "model": model.state_dict(), "optimizer": opt.state_dict()}
    tensors, skeleton = structure.flatten(catchup.snapshot_part(state), torch.is_tensor)
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    print(f"catch-up bill of a {mb:.0f} MB state (mlp, AdamW), {args.sources} source(s), median of "
          f"{args.repeats}; torch threads {torch.get_num_threads()}; load {load0[0]:.2f}")
    print(f"  a training step of the same model: cpu {step_cpu:.3f} s  wall {step_wall:.3f} s")
    published, runs = source_pieces(tensors, skeleton, args.repeats)
    data, fetched = fetch_pieces(published, args.sources, args.repeats)
    runs |= fetched
    j_runs, same = joiner_pieces(data, published.manifest, (model, opt), args.repeats)
    runs |= j_runs
    sums = checksums(published, args.repeats)
    where = {"copy": "source", "publish": "source", "serve": "sources", "fetch": "joiner", "shadow": "joiner",
             "replay": "joiner", "swap": "joiner"}
    print(f"digest algorithm on the wire: {published.manifest.model_dump().get('checksum', 'crc32 (zlib)')}")
    pieces = report(runs, mb, where)
    print("the wire checksum alone (every chunk, one thread):")
    sum_figs = report(sums, mb, {k: "both" for k in sums})
    # Every source copies and hashes its own snapshot; the serving is spread over them.
    source_ms = pieces["copy"]["cpu_ms_per_mb"] + pieces["publish"]["cpu_ms_per_mb"] + \
        pieces["serve"]["cpu_ms_per_mb"] / args.sources
    print(f"one source's bill (copy + publish + 1/{args.sources} of the serving): {source_ms:.3f} ms CPU/MB "
          f"= {source_ms * mb / 1e3:.3f} s CPU for this state, once per catch-up "
          f"({100 * source_ms * mb / 1e3 / step_cpu:.0f}% of one training step's CPU here)")
    print(f"replayed shadow bit-identical to the source: {same}; load after {os.getloadavg()[0]:.2f}")
    print(json.dumps({"benchmark": "catchup_bill", "mb": round(mb, 1), "sources": args.sources,
                      "step": {"cpu_s": round(step_cpu, 4), "wall_s": round(step_wall, 4)},
                      "pieces": pieces, "checksum": sum_figs, "source_cpu_ms_per_mb": round(source_ms, 3),
                      "bit_identical": same, "loadavg": [round(x, 2) for x in (load0[0], os.getloadavg()[0])]}))
    if not same:
        sys.exit(1)


def against_base(args: argparse.Namespace) -> None:
    """This measurement on the checkout and on REV, in alternating processes; medians side by side."""
    from _base import base_env

    figures: dict[str, list[dict]] = {"checkout": [], "base": []}
    cmd = [sys.executable, __file__, "--sources", str(args.sources), "--repeats", str(args.repeats)]
    with base_env(args.base) as env:
        base_launcher = env["PYTHONPATH"].split(":")[0]
        for _ in range(args.pairs):
            for version, lib in (("checkout", ""), ("base", base_launcher)):
                out = subprocess.run(cmd, env={**os.environ, LIBRARY: lib}, capture_output=True, text=True,
                                     check=True, timeout=900).stdout
                figures[version].append(json.loads(out.strip().splitlines()[-1]))
                print(f"{version} run {len(figures[version])}: load {figures[version][-1]['loadavg'][0]}")
    rows = {}
    print(f"ms CPU per MB, median of {args.pairs} runs each: checkout vs {args.base}")
    for piece in figures["checkout"][0]["pieces"]:
        now, then = (statistics.median(f["pieces"][piece]["cpu_ms_per_mb"] for f in figures[v])
                     for v in ("checkout", "base"))
        rows[piece] = {"checkout": now, "base": then, "ratio": round(now / then, 3) if then else None}
        print(f"  {piece:8} {now:7.3f}  base {then:7.3f}  ratio {rows[piece]['ratio']}")
    print(json.dumps({"benchmark": "catchup_bill", "base": args.base, "pairs": args.pairs,
                      "cpu_ms_per_mb": rows, "runs": figures}))


if __name__ == "__main__":
    main()
