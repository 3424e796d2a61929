"""A training loop in which one replica's script is hostile (tests of issue 28's findings 1 and 3).

    transom run --replicas 3 -- python hostile_replica.py --steps 60 --liar 2 --out DIR

Every replica trains a small model at a steady pace. The replica `--liar`, whose script
controls its own process, reports a busy time of 10 us for every step (its rows tell the
detectors it is very fast, so that the others look slow), and with the credential its
launcher gave it tries to speak for replica 0: it posts a failure in replica 0's name and
reads the job's status. It writes the HTTP status of each attempt to DIR/attempts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from transom import contract, ft


def _call(method: str, path: str, body: dict | None = None) -> int:
    env = contract.ReplicaEnv.from_environ()
    with open(env.identity_token_file) as f:
        token = f.read().strip()
    req = urllib.request.Request(env.coordinator_url + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def attack(out: Path) -> None:
    victim = {"replica_id": 0, "generation": 0, "attempt": 0}
    attempts = {"status": _call("GET", "/v1/status"),
                "failure_as_replica_0": _call("POST", "/v1/failure", {"identity": victim, "reason": "framed"})}
    (out / "attempts.json").write_text(json.dumps(attempts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--liar", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step-seconds", type=float, default=0.05)
    args = p.parse_args()
    ctx = ft.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    trainer = ft.FaultTolerant(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx)
    liar = trainer.replica_id == args.liar
    if liar:
        # Its own code: it may say anything about itself.
        trainer._services.clock.busy = lambda: 1e-5  # type: ignore[method-assign]
        if ctx.rank == 0 and os.environ.get(contract.ENV_ATTEMPT, "0") == "0":
            attack(args.out)
    try:
        for step in trainer.steps(args.steps):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(31 * step + trainer.replica_id))
            model(x).pow(2).mean().backward()
            time.sleep(args.step_seconds)
            trainer.report(tokens=8.0)
            trainer.finish_step()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
