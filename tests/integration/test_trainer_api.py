"""FaultTolerant driven directly: two replicas as threads of this process, a real coordinator
on loopback, real Gloo groups between them.

What the ordinary optimizer idiom promises: after `loss.backward()` the gradients are the
average across replicas (so clipping and `GradScaler.unscale_` see them); `optimizer.step()`
of `trainer.optimizer` ends the step; an inf on one replica skips the update on both, with
the same scale back-off; `trainer.no_sync()` accumulates; misuse raises `UsageError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.errors import UsageError
from transom.ft import FaultTolerant, FTConfig
from transom.ft.replica import ReplicaContext

pytestmark = pytest.mark.timeout(120)
TOKEN = "api-token"


def _ctx(url: str, replica: int, replicas: int) -> ReplicaContext:
    env = contract.ReplicaEnv.from_environ({
        contract.ENV_COORDINATOR_URL: url, contract.ENV_COORDINATOR_TOKEN: TOKEN,
        contract.ENV_REPLICA_ID: str(replica), contract.ENV_NUM_REPLICAS: str(replicas)})
    return ReplicaContext(env=env, rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
                          ctrl_group=None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def run_replicas(replicas: int, body: Callable[[int, FaultTolerant, torch.nn.Module], object],
                 optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), bucket_bytes: int = 25 << 20,
                 min_replicas: int | None = None, collective_timeout_s: float = 20,
                 quorum_lease_s: float | None = None,
                 **trainer_kwargs) -> list[object]:
    """`body(replica, trainer, model)` on every replica at once; their results."""
    settings = Settings(job="api", num_replicas=replicas, min_replicas=min_replicas or replicas,
                        **({} if quorum_lease_s is None else {"quorum_lease_s": quorum_lease_s}))
    coordinator = CoordinatorThread(settings, TOKEN)
    url = coordinator.start()
    results: list[object] = [None] * replicas
    errors: list[BaseException] = []
    models = [_model() for _ in range(replicas)]  # built here: the seed is process-wide

    def one(r: int) -> None:
        try:
            model = models[r]
            kwargs = {k: v[r] if isinstance(v, list) else v for k, v in trainer_kwargs.items()}
            trainer = FaultTolerant(model, optimizer(model), _ctx(url, r, replicas), checkpoint=None,
                                    config=FTConfig(collective_timeout_s=collective_timeout_s, quorum_timeout_s=30,
                                                    bucket_bytes=bucket_bytes), **kwargs)
            try:
                results[r] = body(r, trainer, model)
            finally:
                trainer.close(end_job=True)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(replicas)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a replica thread hung"
    finally:
        coordinator.stop()
    if errors:
        raise errors[0]
    return results


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _local_grads(model: torch.nn.Module, replica: int, step: int) -> list[torch.Tensor]:
    """The gradients this replica alone would get (on a copy, outside the trainer)."""
    copy = _model()
    copy.load_state_dict(model.state_dict())
    x, y = _batch(replica, step)
    torch.nn.functional.mse_loss(copy(x), y).backward()
    grads = [p.grad for p in copy.parameters()]
    assert all(g is not None for g in grads)
    return [g.clone() for g in grads if g is not None]


def test_backward_leaves_the_average_across_replicas_and_step_commits():
    def body(r, trainer, model):
        seen = []
        optimizer = trainer.optimizer
        for step in trainer.steps(3):
            local = [_local_grads(model, i, step) for i in range(2)]
            x, y = _batch(r, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            # What clipping would see: the replicas' average, before optimizer.step().
            seen.append(all(torch.allclose(p.grad, (a + b) / 2, atol=1e-6)
                            for p, a, b in zip(model.parameters(), *local)))
            trainer.report(loss)
            optimizer.step()
            optimizer.zero_grad()
            assert trainer.last_step_committed
        return seen, [p.detach().clone() for p in model.parameters()], trainer.step

    (seen0, params0, steps0), (seen1, params1, steps1) = run_replicas(2, body)
    assert seen0 == seen1 == [True, True, True]
    assert steps0 == steps1 == 3
    assert all(torch.equal(a, b) for a, b in zip(params0, params1)), "the replicas diverged"


def test_buckets_leave_during_backward_and_the_result_is_the_exact_average():
    """With buckets smaller than a layer, the exchange of the last layers' gradients starts
    before backward reaches the first layer (it overlaps the rest of the pass), and what
    comes back is still the replicas' average."""
    def body(r, trainer, model):
        first = next(iter(model.parameters()))  # the first layer's weight: its gradient comes last
        in_flight: list[int] = []
        # A gradient hook runs when the first layer's gradient is computed, before it is
        # accumulated (and so before the trainer's own hook sees it).
        exchange = trainer._exchange
        first.register_hook(lambda _: in_flight.append(len(exchange.opened.ftar._pending) if exchange.opened else -1))
        averaged = []
        optimizer = trainer.optimizer
        for step in trainer.steps(3):
            local = [_local_grads(model, i, step) for i in range(2)]
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            averaged.append(all(torch.allclose(p.grad, (a + b) / 2, atol=1e-6)
                                for p, a, b in zip(model.parameters(), *local)))
            optimizer.step()
            optimizer.zero_grad()
        return in_flight, averaged, [p.detach().clone() for p in model.parameters()]

    (flight0, avg0, p0), (flight1, avg1, p1) = run_replicas(2, body, bucket_bytes=64)
    assert avg0 == avg1 == [True, True, True]
    # Two buckets (a bucket closes once it reaches its cap, as DDP's: [last layer, first
    # bias] = 68 bytes, then [first weight]): the first was on the wire before the first
    # layer's weight gradient existed.
    assert flight0 == flight1 == [1, 1, 1], (flight0, flight1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_an_inf_on_one_replica_skips_the_update_on_both_with_the_same_scale():
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]

    def body(r, trainer, model):
        scaler, optimizer = scalers[r], trainer.optimizer
        history = []
        for step in trainer.steps(4):
            x, y = _batch(r, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 2 and r == 1:
                loss = loss * float("inf")  # an overflow on this replica only
            before = [p.detach().clone() for p in model.parameters()]
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # on the averaged gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            history.append((step, trainer.last_step_committed, moved, scaler.get_scale()))
        return history, [p.detach().clone() for p in model.parameters()]

    (h0, p0), (h1, p1) = run_replicas(2, body, scaler=scalers)
    assert h0 == h1, (h0, h1)
    assert [moved for _, _, moved, _ in h0] == [True, True, False, True]  # step 2 skipped everywhere
    assert [committed for _, committed, _, _ in h0] == [True] * 4  # counted, as plain AMP counts it
    assert h0[1][3] == 1024.0 and h0[2][3] == 512.0  # the back-off, once, on both
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_scaler_step_without_unscale_unscales_inside_the_step():
    """GradScaler's contract: `scaler.step(optimizer)` alone must give the same update as an
    explicit unscale_ (the wrapper gets `grad_scale` and divides)."""
    def train(explicit: bool):
        def body(r, trainer, model):
            scaler = trainer.state.scaler
            for step in trainer.steps(3):
                x, y = _batch(r, step)
                scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
                if explicit:
                    scaler.unscale_(trainer.optimizer)
                scaler.step(trainer.optimizer)
                scaler.update()
                trainer.optimizer.zero_grad()
            return [p.detach().clone() for p in model.parameters()]
        return run_replicas(1, body, scaler=torch.amp.GradScaler("cpu", init_scale=256.0))[0]

    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(train(True), train(False)))


def test_no_sync_accumulates_and_a_second_exchange_is_refused():
    def body(r, trainer, model):
        optimizer = trainer.optimizer
        for step in trainer.steps(2):
            x, y = _batch(r, step)
            with trainer.no_sync():
                torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
            local_first = [p.grad.clone() for p in model.parameters()]
            torch.nn.functional.mse_loss(model(x[4:]), y[4:]).backward()
            assert not all(torch.equal(a, p.grad) for a, p in zip(local_first, model.parameters()))
            optimizer.step()
            optimizer.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        # A second backward pass without no_sync would add to gradients already averaged.
        trainer.begin_step()
        x, y = _batch(r, 9)
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(UsageError, match="no_sync"):
            torch.nn.functional.mse_loss(model(x), y).backward()
        return params

    p0, p1 = run_replicas(2, body)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_the_script_cannot_step_the_unwrapped_optimizer_or_step_outside_a_step():
    def body(r, trainer, model):
        raw = trainer.optimizer.wrapped
        with pytest.raises(UsageError, match="stepped directly"):
            raw.step()
        with pytest.raises(UsageError, match="outside a step"):
            trainer.optimizer.step()
        with pytest.raises(UsageError, match="no closure"):
            trainer.optimizer.step(lambda: 0.0)
        # A scheduler accepts the wrapper, and the wrapper shows the wrapped optimizer's groups.
        scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1, gamma=0.5)
        for step in trainer.steps(2):
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.optimizer.step()
            scheduler.step()
        return raw.param_groups[0]["lr"], trainer.optimizer.param_groups is raw.param_groups

    (lr, same_groups), = run_replicas(1, body)
    assert lr == pytest.approx(0.025) and same_groups
