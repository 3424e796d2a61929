"""examples/nanogpt_style/ as a user runs it: the Transom form of a nanoGPT-style script
through a real SIGKILL (the replicas end bit-identical, the evaluations ran, `ckpt.pt` holds
the job's final weights), a whole job stopped and resumed from its own `ckpt.pt` with
`--init-from resume` (it goes on at the saved iter_num, with that iteration's learning rate,
and ends with the weights of a run that never stopped), and the plain DDP form under
torchrun (the left side of the diff in docs/training-api.md is a script that runs).

Evaluation on one replica (`trainer.aside()`) while the others train on makes a run's
result depend on timing: the evaluating replica's share of each step's batch is skipped
until it has caught up. So the runs compared for bit-identity evaluate never
(`--eval-interval` beyond the last iteration), and the SIGKILL run keeps `--min-replicas 2`:
the job waits for the killed replica instead of finishing before its restart (seconds on a
busy machine), and the other replica waits through each evaluation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from test_trainer_api import _batch, run_replicas
from transom import contract
from transom.ft import ScriptState, state_digest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nanogpt_style"
TRAIN, TRAIN_DDP = EXAMPLE / "train.py", EXAMPLE / "train_ddp.py"


def _args(out: Path, data: Path, max_iters: int, *extra: str) -> list[str]:
    return ["--max-iters", str(max_iters), "--out-dir", str(out), "--data-dir", str(data), *extra]


def _ckpt(out: Path) -> dict:
    return torch.load(out / "ckpt.pt", weights_only=True)  # nanoGPT's plain format


def _digest(ckpt: dict) -> str:
    """The digest `transom run` records of a replica's final weights, of the weights in `ckpt`."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.remove(str(EXAMPLE))
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    return state_digest(model)


def _iters(output: str) -> dict[int, str]:
    """The log lines by iteration, without their timing."""
    return {int(m[1]): m[2] for m in re.finditer(r"^iter (\d+): (loss [\d.]+, lr [\d.]+)", output, re.M)}


def test_the_nanogpt_style_example_survives_a_sigkill(transom_run, tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    result = transom_run(["--replicas", "2", "--min-replicas", "2", "--inject", "kill:replica=1,step=30"],
                         _args(out, data, 100, "--eval-interval", "40", "--log-interval", "20"), script=TRAIN)
    assert result.returncode == 0, result.output[-4000:]
    s = result.summary
    assert s["completed_step"] == 100 and s["replicas_bit_identical"] is True, s
    assert s["replica_restarts"] == 1 and result.incarnations(1) == 2 and result.incarnations(0) == 1, \
        (s["events"], result.output[-3000:])
    # One replica evaluated at 40 and 80 (none at 0: no replica holds a committed step yet).
    assert re.findall(r"^step (\d+): train loss [\d.]+, val loss [\d.]+$", result.output, re.M) == ["40", "80"]
    # log_due(20): one writer, one line per logged iteration (a failed step is not printed
    # twice; the replica that catches up prints nothing of its stale weights).
    assert re.findall(r"^iter (\d+): ", result.output, re.M) == ["19", "39", "59", "79", "99"]
    ckpt = _ckpt(out)
    assert ckpt["iter_num"] == 100
    assert set(result.digests().values()) == {_digest(ckpt)}  # the job's final weights


def test_a_stopped_job_resumes_from_its_ckpt_pt_as_if_it_never_stopped(transom_run, tmp_path):
    data = tmp_path / "data"
    quiet = ["--eval-interval", "1000", "--log-interval", "1"]  # no evaluation: see the module docstring
    whole = transom_run(["--replicas", "2"], _args(tmp_path / "whole", data, 40, *quiet), script=TRAIN)
    assert whole.returncode == 0, whole.output[-4000:]
    first = transom_run(["--replicas", "2"], _args(tmp_path / "parts", data, 20, *quiet), script=TRAIN)
    assert first.returncode == 0 and _ckpt(tmp_path / "parts")["iter_num"] == 20, first.output[-4000:]
    second = transom_run(["--replicas", "2"], _args(tmp_path / "parts", data, 40, *quiet, "--init-from", "resume"),
                         script=TRAIN)
    assert second.returncode == 0, second.output[-4000:]
    assert second.summary["completed_step"] == 40 and second.summary["replicas_bit_identical"] is True

    # The second run went on at iteration 20, with iteration 20's learning rate (no warmup
    # again) and the uninterrupted run's loss there; every later line is that run's too.
    logged, expected = _iters(second.output), _iters(whole.output)
    assert min(logged) == 20 and logged == {i: line for i, line in expected.items() if i >= 20}
    assert _iters(first.output) == {i: line for i, line in expected.items() if i < 20}

    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "parts")
    assert a["iter_num"] == b["iter_num"] == 40
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    moments = [(x[k], y[k]) for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values())
               for k in x]
    assert moments and all(torch.equal(x, y) for x, y in moments)
    assert set(second.digests().values()) == set(whole.digests().values()) == {_digest(a)}


def test_the_plain_ddp_form_runs_under_torchrun(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TRAIN_DDP),
           *_args(out, tmp_path / "data", 6, "--eval-interval", "5", "--eval-iters", "2", "--log-interval", "1")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert re.findall(r"^step (\d+): train loss", proc.stdout, re.M) == ["0", "5"]  # the master process only
    assert sorted(_iters(proc.stdout)) == list(range(6))
    assert _ckpt(out)["iter_num"] == 6


def test_a_value_set_aside_reaches_every_replica(monkeypatch):
    """What the example's `best_val_loss` needs: the value one replica sets in the ScriptState
    while it evaluates aside is, afterwards, every replica's (replica state is the same on
    every replica), so whichever replica writes the next ckpt.pt compares against it."""
    # Replicas as threads (test_trainer_api.run_replicas): no launcher forwards signal rows,
    # so nobody could vouch for the catch-up's snapshot; the detectors are off.
    monkeypatch.setenv(contract.ENV_DETECTION, json.dumps({"enabled": False}))
    scripts = [ScriptState(best_val_loss=1e9) for _ in range(2)]
    evaluated = threading.Event()  # once in the job, as an evaluation at one iteration

    def body(r, trainer, model):
        for step in trainer.steps(40):
            if step >= 5 and not evaluated.is_set() and trainer.is_writer_replica:
                evaluated.set()
                with trainer.aside():  # the other replica trains on
                    scripts[r]["best_val_loss"] = 0.5
                    time.sleep(0.5)
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            time.sleep(0.05)
        return trainer.step

    assert run_replicas(2, body, min_replicas=1, extra_state=[{"script": s} for s in scripts]) == [40, 40]
    assert [s["best_val_loss"] for s in scripts] == [0.5, 0.5]
