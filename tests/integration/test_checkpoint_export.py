"""`transom checkpoint export`: a real training run's checkpoint as a plain PyTorch file.

The tiny GPT example runs under `transom run` with a checkpoint URI; the exported file,
read with `torch.load(..., weights_only=True)`, loads into a fresh model, which then holds
bit for bit the weights the replicas ended with (their summary digests), also when FSDP2
sharded the state over the ranks of each replica. A missing step, a corrupted blob and an
unwritable destination exit 2 with one line and leave the destination as it was.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from test_checkpoint import assert_same as checkpoint_assert_same
from transom import cli
from transom.checkpoint import layout
from transom.checkpoint.assemble import chunk_length
from transom.checkpoint.engine import CheckpointConfig, CheckpointEngine
from transom.checkpoint.restore import load_latest
from transom.ft.config import state_digest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--dim", "32", "--context", "32", "--batch-size", "8"]


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transom", "checkpoint", "export", *args],
                          capture_output=True, text=True, timeout=120)


def tiny_gpt(context: int = 32) -> torch.nn.Module:
    """A fresh model of the example's architecture with SMALL's sizes (other weights than any run's)."""
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", ROOT / "examples" / "train_tiny_gpt.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(123)
    return example.TinyGPT(len(set(example.make_corpus())), dim=32, context=context)


def plain_values(obj) -> bool:
    """Only what `weights_only` loading allows and an export promises: tensors and plain data."""
    if isinstance(obj, torch.Tensor):
        return type(obj) is torch.Tensor and obj.device.type == "cpu"
    if isinstance(obj, (dict, list, tuple)):
        items = obj.values() if isinstance(obj, dict) else obj
        return type(obj) in (dict, list, tuple) and all(map(plain_values, items))
    return obj is None or isinstance(obj, (bool, int, float, str))


def assert_same(a, b) -> None:
    """As test_checkpoint's, and the names in the order the model's state_dict() gave them."""
    checkpoint_assert_same(a, b, ordered=True)


@pytest.mark.slow
def test_export_of_a_training_run_is_the_replicas_final_weights(transom_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    run = transom_run(["--replicas", "2", "--checkpoint-uri", str(ckpt)], ["--steps", "4", *SMALL])
    assert run.returncode == 0, run.output[-4000:]
    digests = run.digests()
    assert len(digests) == 2 and len(set(digests.values())) == 1

    done = export_cli("latest", "--uri", str(ckpt), "--to", str(tmp_path / "model.pt"))
    assert done.returncode == 0, done.stderr
    assert re.match(r"wrote step 4's model \(\d+ tensors, [\d.]+ MiB\) to ", done.stdout)
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert type(weights) is dict and plain_values(weights)
    model = tiny_gpt()
    assert list(weights) == list(model.state_dict())  # the model's own names: nothing of Transom's added
    model.load_state_dict(weights, strict=True)
    assert state_digest(model) == digests[(0, 0)], "the file must hold the weights the replicas ended with"

    done = export_cli("4", "--uri", str(ckpt), "--to", str(tmp_path / "full.pt"), "--include-optimizer")
    assert done.returncode == 0, done.stderr
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(full) == ["model", "optimizer", "step"] and full["step"] == 4 and plain_values(full)
    saved = load_latest(str(ckpt)).state  # what a restore reads: the same model and optimizer state
    assert_same(full["model"], weights)
    assert_same(full["optimizer"], saved["optimizer"])
    torch.optim.AdamW(model.parameters()).load_state_dict(full["optimizer"])


def shard_digest(weights: dict[str, torch.Tensor], rank: int, ranks: int) -> str:
    """`state_digest` of an FSDP2 rank whose parameters are the Shard(0) parts of `weights`."""
    h = hashlib.sha256()
    for name, t in sorted(weights.items()):
        start = sum(chunk_length(t.shape[0], ranks, r) for r in range(rank))
        h.update(name.encode())
        h.update(t.narrow(0, start, chunk_length(t.shape[0], ranks, rank)).contiguous().view(torch.uint8)
                 .numpy().tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_export_of_an_fsdp2_checkpoint_joins_the_ranks_shards(transom_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    # A context of 33 positions: the position embedding's 33 rows split 17 + 16, as torch.chunk cuts.
    run = transom_run(["--replicas", "2", "--nproc-per-replica", "2", "--checkpoint-uri", str(ckpt)],
                      ["--steps", "3", "--inner", "fsdp", *SMALL, "--context", "33"])
    assert run.returncode == 0, run.output[-4000:]
    manifest = layout.Manifest.from_json((ckpt / layout.step_dir(3) / layout.MANIFEST).read_text())
    assert manifest.num_shards == 2  # sharded: each rank stored its own part of every parameter

    done = export_cli("latest", "--uri", str(ckpt), "--to", str(tmp_path / "model.pt"))
    assert done.returncode == 0, done.stderr
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert plain_values(weights)
    assert weights["pos.weight"].shape == (33, 32)
    tiny_gpt(context=33).load_state_dict(weights, strict=True)  # whole tensors, the unsharded model's names and shapes
    digests = run.digests()
    for rank in range(2):  # the parts of the whole tensors that each rank held are what it ended with
        assert shard_digest(weights, rank, 2) == digests[(0, rank)] == digests[(1, rank)]


def write_checkpoint(uri: Path, step: int) -> dict:
    """A committed checkpoint of a small model's state, written by two writers; the model's state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    state: dict[str, Any] = {"model": model.state_dict(),
                             "optimizer": torch.optim.Adam(model.parameters()).state_dict(), "step": step}
    engines = [CheckpointEngine(CheckpointConfig(uri=str(uri))) for _ in range(2)]
    for writer, engine in enumerate(engines):
        assert engine.save(step, state, layout.Slot(writer=writer, writers=2), attempt="run-1")
    for engine in engines:
        engine.wait_snapshot()
        assert engine.wait_persisted(60)
        engine.close()
    return state["model"]


@pytest.mark.parametrize("case", ["missing step", "corrupt blob", "unwritable destination"])
def test_export_errors_exit_2_in_one_line_and_leave_the_destination_as_it_was(tmp_path, capsys, case):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    write_checkpoint(ckpt, 5)
    out.mkdir()
    (out / "model.pt").write_bytes(b"previous")  # an earlier export stays as it was
    step, dest = "5", out / "model.pt"
    if case == "missing step":
        step, expected = "7", f"no committed checkpoint of step 7 under {re.escape(str(ckpt))} \\(committed: 5\\)"
    elif case == "corrupt blob":
        manifest = layout.Manifest.from_json((ckpt / layout.step_dir(5) / layout.MANIFEST).read_text())
        entry = next(e for e in manifest.entries if e.key == "model/0.weight")
        path = ckpt / layout.step_dir(5) / entry.file
        data = bytearray(path.read_bytes())
        data[entry.offset + entry.length // 2] ^= 0x01  # one bit inside the tensor's blob
        path.write_bytes(bytes(data))
        expected = (f"checkpoint step 5 under {re.escape(str(ckpt))} does not verify: "
                    f"{re.escape(entry.file)}: CRC-32 differs from the manifest's")
    else:
        dest, expected = out / "missing" / "model.pt", "cannot write .*model.pt: No such file or directory"
    code = cli.main(["checkpoint", "export", step, "--uri", str(ckpt), "--to", str(dest)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(f"transom checkpoint export: {expected}", err.strip()), err
    assert [p.name for p in out.iterdir()] == ["model.pt"] and (out / "model.pt").read_bytes() == b"previous"


def test_export_of_an_engine_checkpoint_by_two_writers_round_trips(tmp_path, capsys):
    model = write_checkpoint(tmp_path / "ckpt", 5)
    assert cli.main(["checkpoint", "export", "5", "--uri", str(tmp_path / "ckpt"), "--to",
                     str(tmp_path / "model.pt")]) == 0
    assert "wrote step 5's model (4 tensors" in capsys.readouterr().out
    assert_same(torch.load(tmp_path / "model.pt", weights_only=True), dict(model))
