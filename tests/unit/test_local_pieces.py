"""Pure pieces of the worker and launcher side: fault specs, run summary, LR scaling, buckets.

No processes here; the behaviour under real faults is in tests/integration.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from transom import contract, inject
from transom.ft.config import FTConfig, lr_factor
from transom.ft.ftar import plan_buckets
from transom.launch.summary import stall_seconds, summarize


@pytest.mark.parametrize(
    "text, expected",
    [
        ("kill:step=3", inject.Fault("kill", 3)),
        ("stop:step=0,rank=1", inject.Fault("stop", 0, rank=1)),
        ("raise:step=7,phase=forward", inject.Fault("raise", 7, phase="forward")),
    ],
)
def test_fault_parse(text, expected):
    assert inject.Fault.parse(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("explode:step=1", "action"),
        ("kill:rank=1", "step"),
        ("kill:step=-1", "step"),
        ("kill:step=1,when=now", "unknown"),
        ("kill:step=1,phase=backward", "phase"),
        ("kill:step", "key=value"),
    ],
)
def test_fault_parse_rejects_with_reason(text, message):
    with pytest.raises(ValueError, match=message):
        inject.Fault.parse(text)


def test_targeted_fault_and_per_attempt_selection():
    assert inject.parse_targeted("kill:replica=2,step=20") == (2, "kill:step=20")
    with pytest.raises(ValueError, match="replica"):
        inject.parse_targeted("kill:step=20")
    env = {"TRANSOM_FAULT": "kill:step=5;stop:step=9"}
    assert inject.from_environ(0, env) == inject.Fault("kill", 5)
    assert inject.from_environ(1, env) == inject.Fault("stop", 9)
    assert inject.from_environ(2, env) is None


@pytest.mark.parametrize(
    "scaling, participants, replicas, factor",
    [("none", 2, 4, 1.0), ("linear", 2, 4, 0.5), ("sqrt", 2, 4, math.sqrt(0.5)), ("sqrt", 3, 3, 1.0)],
)
def test_lr_factor(scaling, participants, replicas, factor):
    assert lr_factor(scaling, participants, replicas) == pytest.approx(factor)


def test_ft_config_rejects_bad_values_and_explicit_beats_environment(monkeypatch):
    with pytest.raises(ValueError, match="lr_scaling"):
        FTConfig(lr_scaling="cubic")
    with pytest.raises(ValueError, match="positive"):
        FTConfig(collective_timeout_s=0)
    monkeypatch.setenv("TRANSOM_COLLECTIVE_TIMEOUT_S", "7")
    assert FTConfig.from_environ().collective_timeout_s == 7.0
    assert FTConfig.from_environ(collective_timeout_s=2.0).collective_timeout_s == 2.0


def test_plan_buckets_caps_size_and_separates_dtypes():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    buckets = plan_buckets(grads, bucket_bytes=80)  # room for two float32 tensors of 10
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3]
    assert [0, 1] in buckets and [2] in buckets and [3] in buckets  # an oversized tensor gets its own


def test_the_first_bucket_of_each_kind_is_small_so_it_leaves_early():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64),
             torch.zeros(10, dtype=torch.float64)]
    # As DDP: the gradients backward produces first leave in a small bucket of their own.
    assert plan_buckets(grads, bucket_bytes=1000, first_bucket_bytes=40) == [[0], [1, 2], [3], [4]]


def test_stall_counts_only_disrupted_steps_beyond_normal():
    rec = lambda s, **kw: {"seconds": s, "committed": True, "quorum_changed": False, **kw}  # noqa: E731
    records = [
        rec(5.0, quorum_changed=True),  # start-up: ignored
        rec(0.1), rec(0.1), rec(0.1),
        rec(0.4, committed=False),  # failed attempt: 0.3 lost
        rec(0.3, quorum_changed=True),  # retry under the new quorum: 0.2 lost
        rec(0.1),
    ]
    assert stall_seconds(records) == pytest.approx(0.5)
    assert stall_seconds([rec(1.0), rec(0.1), rec(0.1)]) == 0.0


def _write(dir_, name, lines):
    (dir_ / name).write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_summarize_bit_identity_compares_the_replicas_that_finished(tmp_path):
    ok = {"committed": True, "quorum_changed": False, "seconds": 0.1, "loss": 1.0}
    _write(tmp_path, "steps-r0-g0-a0.jsonl", [ok] * 3)
    _write(tmp_path, "steps-r1-g0-a0.jsonl", [ok])
    _write(tmp_path, "steps-r1-g0-a1.jsonl", [ok] * 2)
    (tmp_path / "final-r0-k0.json").write_text(json.dumps({"replica": 0, "rank": 0, "step": 3, "digest": "aa"}))
    s = summarize(tmp_path, 2, {1: 1}, 1.0)
    assert s["replicas_bit_identical"] is None  # replica 1 never finished: nothing to compare replica 0 with
    assert s["replica_restarts"] == 1 and s["failures_injected"] == 1 and s["final_loss"] == 1.0
    (tmp_path / "final-r1-k0.json").write_text(json.dumps({"replica": 1, "rank": 0, "step": 3, "digest": "aa"}))
    assert summarize(tmp_path, 2, {}, 1.0)["replicas_bit_identical"] is True
    (tmp_path / "final-r1-k0.json").write_text(json.dumps({"replica": 1, "rank": 0, "step": 3, "digest": "bb"}))
    assert summarize(tmp_path, 2, {}, 1.0)["replicas_bit_identical"] is False


def test_the_summary_of_a_run_that_diverged_is_json_with_null_for_nan(tmp_path):
    from transom.launch.summary import finite_json

    nan = {"committed": True, "quorum_changed": False, "seconds": 0.1, "loss": math.nan}
    _write(tmp_path, "steps-r0-g0-a0.jsonl", [nan] * 3)
    summary = {**summarize(tmp_path, 1, {}, 1.0), "events": [{"t": math.inf, "what": "x"}]}
    assert math.isnan(summary["final_loss"])

    def strict(token: str):
        raise AssertionError(f"{token} is not JSON")

    again = json.loads(finite_json(summary, indent=2), parse_constant=strict)
    assert again["final_loss"] is None and again["events"] == [{"t": None, "what": "x"}]
    assert again["steps_committed"] == summary["steps_committed"]


def test_replica_env_errors_name_the_variable():
    with pytest.raises(ValueError, match=contract.ENV_COORDINATOR_URL):
        contract.ReplicaEnv.from_environ({contract.ENV_REPLICA_ID: "0", contract.ENV_NUM_REPLICAS: "1"})
    with pytest.raises(ValueError, match=contract.ENV_REPLICA_ID):
        contract.ReplicaEnv.from_environ({contract.ENV_COORDINATOR_URL: "http://x", contract.ENV_REPLICA_ID: "a"})


def test_transom_core_imports_without_torch():
    """The launcher and coordinator run where torch may be absent: poison it and import."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['kopf'] = None; sys.modules['kubernetes'] = None\n"
        "import transom, transom.cli, transom.contract, transom.inject\n"
        "import transom.coordinator.server, transom.coordinator.client\n"
        "import transom.launch.supervisor, transom.launch.local\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_first_restart_is_immediate_and_later_ones_back_off():
    from transom.launch.supervisor import restart_delay_s

    assert [restart_delay_s(a, 0.5) for a in (1, 2, 3, 4)] == [0.0, 0.5, 1.0, 2.0]
    assert restart_delay_s(20, 0.5) == 30.0
    assert restart_delay_s(5000, 0.5) == 30.0  # 2**4998 is past a float: no OverflowError after 1,026 restarts


def test_a_transfer_waits_for_the_link_while_the_exchange_holds_it_but_not_forever():
    import threading
    import time

    from transom.ft.transfer import LinkGate

    gate = LinkGate(max_wait_s=5.0)
    gate.busy()
    passed = threading.Event()
    t = threading.Thread(target=lambda: (gate.wait_free(), passed.set()))
    t.start()
    time.sleep(0.1)
    assert not passed.is_set()  # held back while the gradients move
    gate.free()
    assert passed.wait(2)
    t.join()
    stuck = LinkGate(max_wait_s=0.05)
    stuck.busy()
    t0 = time.monotonic()
    stuck.wait_free()  # an exchange stuck in its collective timeout: the chunk goes anyway
    assert time.monotonic() - t0 < 1
    off = LinkGate(enabled=False)
    off.busy()
    t0 = time.monotonic()
    off.wait_free()
    assert time.monotonic() - t0 < 0.05


def test_recovery_yield_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("TRANSOM_RECOVERY_YIELD", "0")
    assert FTConfig.from_environ().recovery_yields is False
    monkeypatch.setenv("TRANSOM_RECOVERY_YIELD", "yes")
    with pytest.raises(ValueError, match="TRANSOM_RECOVERY_YIELD"):
        FTConfig.from_environ()
