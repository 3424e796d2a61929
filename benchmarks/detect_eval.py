"""Anomaly detection on synthetic traces: Transom's detectors against a naive threshold.

    .venv/bin/python benchmarks/detect_eval.py [--clean-steps 10000] [--seed 0]

Traces (transom/detect/synthetic.py): 4 replicas x 4 ranks, packed batches of 8192 tokens
cut from long-tailed documents, busy time ~ tokens + sum of squared lengths + noise, so a
healthy rank's step time varies several-fold with its batch. Measured:

- false alarms per 10,000 rank-steps on a clean trace: Transom's verdicts (the detectors start
  over for a replica after each one, as after a replacement), the naive detector's alarms
  (a rank's step > 1.25x the rolling median of its last 50 steps), and a persistent naive
  variant (10 such steps in a row, as Transom asks of a slow rank);
- detection delay in steps for a rank slowed 1.2x, 1.3x, 1.5x and 2x from step 300
  (steps from the injection to the verdict; None: never within the trace), and for one
  slowed 1.3x from its first step (a replacement placed on a degraded device: there is no
  "before" to compare with, only the other ranks);
- hangs, non-finite losses (3 steps) and a flipped bit (caught at the next fingerprint).

- one replica that lies about its busy time (x1e-5 to x1e4), in jobs of 3 and 4 replicas:
  the verdicts against the others, and the delay for a replica really 1.5x slow beside it.

Targets: 0 false alarms where the naive detector raises many; 1.3x within 20 steps; a bit
flip caught at the next fingerprint; no verdict against an honest replica from a liar's
figures. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))

from transom.detect.detectors import Detectors, Verdict  # noqa: E402
from transom.detect.step_rows import DetectionSettings, Signal  # noqa: E402
from transom.detect.synthetic import Injection, TraceSpec, generate  # noqa: E402

NAIVE_FACTOR = 1.25
NAIVE_WINDOW = 50
NAIVE_PERSIST = 10
INJECT_AT = 300
SLOW_FACTORS = (1.2, 1.3, 1.5, 2.0)


def transom_verdicts(rows: list[Signal], settings: DetectionSettings) -> list[Verdict]:
    d = Detectors(settings)
    out: list[Verdict] = []
    for row in rows:
        for v in d.observe(row):
            out.append(v)
            d.forget(v.replica)  # the replica is replaced: a new incarnation starts over
    return out + d.flush()


def naive_alarms(rows: list[Signal], persist: int = 1) -> list[tuple[int, int, int]]:
    """(step, replica, rank) of each alarm: step time above NAIVE_FACTOR x the rank's rolling
    median, `persist` steps in a row."""
    recent: dict[tuple[int, int], collections.deque[float]] = {}
    run: collections.Counter[tuple[int, int]] = collections.Counter()
    out = []
    for r in rows:
        key = (r.replica, r.rank)
        window = recent.setdefault(key, collections.deque(maxlen=NAIVE_WINDOW))
        if len(window) >= 10 and r.step_seconds > NAIVE_FACTOR * statistics.median(window):
            run[key] += 1
            if run[key] == persist:
                out.append((r.step, r.replica, r.rank))
                run[key] = 0
        else:
            run[key] = 0
        window.append(r.step_seconds)
    return out


def per_10k(count: int, spec: TraceSpec) -> float:
    """Alarms per 10,000 rank-steps (one rank's step: what each detector judges)."""
    return round(count * 10_000 / (spec.steps * spec.replicas * spec.ranks), 2)


def slow_delays(seed: int, settings: DetectionSettings) -> dict[str, dict]:
    out = {}
    cases = [(f"{factor:g}x", factor, INJECT_AT) for factor in SLOW_FACTORS] + [("1.3x from start", 1.3, 0)]
    for name, factor, at in cases:
        rows = list(generate(TraceSpec(steps=INJECT_AT + 200, seed=seed + 1,
                                       injections=[Injection("slow", 1, 2, at, factor)])))
        verdicts = transom_verdicts(rows, settings)
        found = [v for v in verdicts if v.kind == "slow" and (v.replica, v.rank) == (1, 2)]
        naive = [a for a in naive_alarms(rows) if a[1:] == (1, 2) and a[0] >= at]
        out[name] = {
            "delay_steps": found[0].reached_step - at if found else None,
            "naive_delay_steps": naive[0][0] - at if naive else None,
            "other_verdicts": len([v for v in verdicts if (v.replica, v.rank) != (1, 2)]),
        }
    return out


def _key(name: str) -> str:
    """'1.3x' -> '1_3x', '1.3x from start' -> '1_3x_from_start' (the JSON keys)."""
    return name.replace(".", "_").replace(" ", "_")


def fault_delays(seed: int, settings: DetectionSettings) -> dict[str, int | None]:
    sdc_at = 3 * settings.fingerprint_interval + 7  # between two fingerprints
    injections = [Injection("hang", 2, 0, 250), Injection("nan", 3, 1, 300, steps=3), Injection("sdc", 0, 3, sdc_at)]
    rows = list(generate(TraceSpec(steps=500, seed=seed + 2, fingerprint_interval=settings.fingerprint_interval,
                                   injections=injections)))
    verdicts = transom_verdicts(rows, settings)

    def delay(kind: str, replica: int, at: int) -> int | None:
        hit = [v for v in verdicts if v.kind == kind and v.replica == replica]
        return hit[0].reached_step - at if hit else None

    next_fingerprint = -(-sdc_at // settings.fingerprint_interval) * settings.fingerprint_interval
    return {"hang_delay_steps": delay("hang", 2, 250), "nan_delay_steps": delay("nan", 3, 300),
            "sdc_delay_steps": delay("sdc", 0, sdc_at), "sdc_next_fingerprint_delay": next_fingerprint - sdc_at,
            "unexpected_verdicts": len([v for v in verdicts if (v.kind, v.replica) not in
                                        (("hang", 2), ("nan", 3), ("sdc", 0))])}


LIES = (1e-5, 0.5, 2.0, 1e4)  # what a lying replica multiplies its busy times by


def liars(seed: int, settings: DetectionSettings) -> dict[str, int | None]:
    """One replica that reports its busy time times each of LIES (issue 28's probe: 1e-5 made
    the two honest replicas of three "2x slow"), in jobs of 3 and 4 replicas of one rank each
    (with several ranks a replica's own ranks outvoted the liar's even before): the verdicts
    against any other replica; and beside such a liar (1e-5), a replica really 1.5x slow
    from step INJECT_AT: how long until it is named."""
    against = 0
    for replicas in (3, 4):
        for lie in LIES:
            trace = generate(TraceSpec(replicas=replicas, ranks=1, steps=INJECT_AT + 200, seed=seed + 3))
            rows = [dataclasses.replace(r, step_seconds=r.step_seconds * lie) if r.replica == replicas - 1 else r
                    for r in trace]
            against += len([v for v in transom_verdicts(rows, settings) if v.replica != replicas - 1])
    trace = generate(TraceSpec(replicas=3, ranks=1, steps=INJECT_AT + 200, seed=seed + 3,
                               injections=[Injection("slow", 0, 0, INJECT_AT, 1.5)]))
    rows = [dataclasses.replace(r, step_seconds=r.step_seconds * 1e-5) if r.replica == 2 else r for r in trace]
    found = [v for v in transom_verdicts(rows, settings) if v.kind == "slow" and v.replica == 0]
    return {"liar_cases": 2 * len(LIES), "liar_verdicts_against_others": against,
            "slow_beside_liar_delay_steps": found[0].reached_step - INJECT_AT if found else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clean-steps", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    settings = DetectionSettings()
    started = time.monotonic()
    spec = TraceSpec(steps=args.clean_steps, seed=args.seed)
    clean = list(generate(spec))
    lengths = [r.step_seconds for r in clean if (r.replica, r.rank) == (0, 0)]
    print(f"clean trace: {spec.steps} steps x {spec.replicas} replicas x {spec.ranks} ranks; a healthy rank's step "
          f"{min(lengths):.3f}-{max(lengths):.3f} s, median {statistics.median(lengths):.3f} s")
    false_t = transom_verdicts(clean, settings)
    false_n = naive_alarms(clean)
    false_p = naive_alarms(clean, NAIVE_PERSIST)
    print(f"false alarms per 10k rank-steps: transom {per_10k(len(false_t), spec)}, naive "
          f"{per_10k(len(false_n), spec)}, naive {NAIVE_PERSIST} in a row {per_10k(len(false_p), spec)}")
    slow = slow_delays(args.seed, settings)
    for name, r in slow.items():
        print(f"slow {name}: transom delay {r['delay_steps']} steps, naive {r['naive_delay_steps']} "
              f"(other verdicts: {r['other_verdicts']})")
    faults = fault_delays(args.seed, settings)
    print(f"hang: {faults['hang_delay_steps']} steps; nan (3 steps): {faults['nan_delay_steps']}; bit flip: "
          f"{faults['sdc_delay_steps']} (next fingerprint {faults['sdc_next_fingerprint_delay']}); unexpected "
          f"verdicts {faults['unexpected_verdicts']}")
    lying = liars(args.seed, settings)
    print(f"one replica lying about its busy time (x{', x'.join(f'{x:g}' for x in LIES)}; 3 and 4 replicas of 1 rank): "
          f"{lying['liar_verdicts_against_others']} verdicts against the others in {lying['liar_cases']} traces; "
          f"a 1.5x slow replica beside a liar: transom delay {lying['slow_beside_liar_delay_steps']} steps")
    result = {
        "benchmark": "detect_eval", "clean_steps": spec.steps, "replicas": spec.replicas, "ranks": spec.ranks,
        "false_alarms_per_10k": per_10k(len(false_t), spec),
        "naive_false_alarms_per_10k": per_10k(len(false_n), spec),
        "naive_persistent_false_alarms_per_10k": per_10k(len(false_p), spec),
        **{f"delay_steps_{_key(k)}": v["delay_steps"] for k, v in slow.items()},
        **{f"naive_delay_steps_{_key(k)}": v["naive_delay_steps"] for k, v in slow.items()},
        **faults,
        **lying,
        "sdc_caught": (sdc := faults["sdc_delay_steps"]) is not None
        and sdc <= (faults["sdc_next_fingerprint_delay"] or 0),
        "seconds": round(time.monotonic() - started, 1),
    }
    result["ok"] = (result["false_alarms_per_10k"] == 0 and result["delay_steps_1_3x"] is not None
                    and result["delay_steps_1_3x"] <= 20 and result["sdc_caught"]
                    and result["delay_steps_1_3x_from_start"] is not None
                    and result["liar_verdicts_against_others"] == 0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
