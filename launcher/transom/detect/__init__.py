"""Anomaly detection: what every rank reports per step, the detectors that read it, and the
verdicts they reach.

Pure logic, no torch and no I/O, so the same code runs in the coordinator (on the signals the
launchers forward, coordinator/detection.py), in `transom detect replay` (over a recorded
trace) and in the tests:

- signals.py   one rank's step (`Signal`), the CSV trace format, `DetectionSettings`
- slow.py      fail-slow: a workload-aware step-time predictor fitted online per rank
- loss.py      loss spikes against a replica's own history, and non-finite steps
- sdc.py       silent data corruption: parameter fingerprints compared across replicas
- duplicates.py replicas (or ranks) that train on identical inputs: input digests compared
- detectors.py all of them over a stream of signals, step by step: `Detectors`, `Verdict`
- hangs.py     whom a hang waits for: the ranks' counts of collectives entered and completed

The decisions inside a step (a non-finite or spiking step is applied on no replica) are the
trainer's (ft/guard.py); the hang watchdog is the launcher's (launch/watchdog.py).
"""
