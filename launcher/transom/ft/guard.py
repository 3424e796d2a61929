"""The worker's part of anomaly detection: a step that must not be applied, and the signals.

Per step, each rank:

- keeps the norm of its *own* gradients, taken from each bucket as FTAR flattens it (before
  the exchange sums it with the other replicas'): the only place where a rank's own
  non-finite gradients can be told from everyone's;
- judges its step at the vote: its loss or its own gradients not finite, or its loss a spike
  against the replica's own recent losses (detect/loss.py). One read of two scalars from the
  device, the same synchronisation GradScaler makes for its inf check;
- agrees with every replica and every rank of its replica (the vote) whether anyone found
  its step bad: then no replica applies the step's update (it is committed without one, like
  GradScaler's skipped step), and every replica stays identical. Across replicas the
  agreement rides with the gradients: two flags at the end of the step's last bucket
  (`flags`), summed by the same all-reduce. BAD: its own gradients are not finite, or the
  loss reported before that bucket left is not finite or spikes. LATE: it may still report
  a loss before `optimizer.step()` (it reported one in an earlier step, or this is its
  first): then every member agrees once more, on its whole judgement, with a 1-element
  all-reduce of its own. A loop that reports no loss, or reports it before backward ends,
  so needs no collective for the guard; one that reports it after backward needs that one.
  (A rank's very first loss, reported after backward in a step that is not its first, is
  judged for its row but cannot stop the update alone; a first loss is never a spike: the
  history is empty);
- every `fingerprint_interval` committed steps, fingerprints its parameters and optimizer
  state after the update: the sum of their raw bits as 64-bit integers, on the device. Integer addition does not
  depend on the order, and any flipped bit changes the sum;
- appends a row to `signals-r<replica>-g<generation>-a<attempt>-k<rank>.csv` in the
  launcher's TRANSOM_SIGNALS_DIR (the trace format, detect/step_rows.py): its busy time (the
  step less the time spent waiting for the quorum, the exchange and the votes), the workload
  the script reported, loss, gradient norm, finiteness, fingerprint, and on some steps the
  digest of its input (ft/input_digest.py). The launcher forwards the rows to the
  coordinator (launch/signal_forwarder.py), which runs the detectors.

It also registers a handler that writes every thread's stack to `stacks-...-k<rank>.txt` on
SIGUSR1: the launcher's hang watchdog asks for it before it restarts a hung replica. And it
keeps one byte in `waiting-...-k<rank>` set while the rank waits for others (its quorum, the
exchange, the votes): a job paused below minReplicas, or a replica whose peer hangs, is
waiting, not hung (each of those waits has its own timeout), and the watchdog does not count
that time. And it mirrors the process's collective counts (transom/collective_counts.py) into
`collectives-...-k<rank>`, which the launcher forwards: at a hang they name the rank that never
arrived (detect/hangs.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import faulthandler
import math
import mmap
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

import torch

from transom.collective_counts import COUNTER
from transom.detect.loss import LossHistory
from transom.detect.step_rows import DetectionSettings, Signal, write_trace
from transom.ft.ftar import NUM_FLAGS

STACK_SIGNAL = signal.SIGUSR1
BAD, LATE = 0, 1  # the flags at the end of the last bucket (ftar.NUM_FLAGS of them)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the parameters' raw bits as int64 (a 0-dim tensor on their device)."""
    total = None
    for p in params:
        to_local = getattr(p, "to_local", None)  # a DTensor's: its shard
        local: torch.Tensor = to_local() if callable(to_local) else p
        flat = local.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)
        total = bits if total is None else total.to(bits.device) + bits
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def state_tensors(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What replicas must hold bit for bit alike: the parameters and every tensor of the
    optimizer's state (its moments, its step counts). A fingerprint sums them in any order."""
    out = list(params)
    for per_param in optimizer.state.values():
        out += [v for v in per_param.values() if torch.is_tensor(v)]
    return out


class Guard:
    """One rank's detection state for one incarnation; `close()` ends what it started."""

    def __init__(self, settings: DetectionSettings, directory: str | None, replica: int, generation: int,
                 attempt: int, rank: int, gradients_judged: bool = True):
        """`gradients_judged` False: an AMP GradScaler owns inf/NaN gradients (it skips such
        steps itself, the same on every replica): only the loss is judged."""
        self.settings = settings
        self.gradients_judged = gradients_judged
        self.replica, self.rank = replica, rank
        self._losses = LossHistory(settings.loss_window, settings.loss_spike_z)
        self._squares: list[torch.Tensor] = []  # this step's own buckets' squared norms
        self._workload: tuple[float | None, float | None] = (None, None)
        self._reported: torch.Tensor | float | None = None  # this step's loss, as report() gave it
        self._ever_reported = False  # a loss, in any step of this incarnation
        self._expects_loss = True  # it may report a loss late: it did before, or no step ended yet
        self.finite, self.spike = True, False  # this step's own judgement
        self._file: TextIO | None = None
        # Rows waiting for the fingerprint a joiner's snapshot is checked against (committed()).
        self._held: list[tuple[Signal, concurrent.futures.Future[int]]] = []
        self._stacks: TextIO | None = None
        self._waiting: mmap.mmap | None = None  # the waiting byte, mapped: set without a syscall
        if directory:
            base = Path(directory)
            base.mkdir(parents=True, exist_ok=True)
            name = f"r{replica}-g{generation}-a{attempt}-k{rank}"
            self._file = open(base / f"signals-{name}.csv", "w", buffering=1, newline="")
            write_trace([], self._file)  # the header
            self._stacks = open(base / f"stacks-{name}.txt", "w")
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
            fd = os.open(base / f"waiting-{name}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.pwrite(fd, b"0", 0)
                # Set and cleared about six times a step: a store into the shared page, which
                # the launcher's read sees, instead of a write call each time.
                self._waiting = mmap.mmap(fd, 1)
            finally:
                os.close(fd)
            COUNTER.attach(base / f"collectives-{name}")  # read by the launcher at a hang

    # --- during the step -----------------------------------------------------------------------
    def begin(self) -> None:
        self._squares, self._workload, self._reported = [], (None, None), None
        self.finite, self.spike = True, False

    def waiting(self, yes: bool) -> None:
        """This rank waits for its quorum now (yes) or not any more."""
        if self._waiting is not None:
            self._waiting[0] = 0x31 if yes else 0x30  # "1" / "0"

    def reported(self, loss: torch.Tensor | float | None, tokens: float | None, sum_len_sq: float | None) -> None:
        self._reported, self._workload = loss, (tokens, sum_len_sq)

    def own_bucket(self, flat: torch.Tensor) -> None:
        """A bucket of this rank's own gradients, before the exchange (ftar.StepAllReduce)."""
        # A dot product: a third less time than vector_norm on the CPU, on every step's path.
        square = flat.dot(flat) if flat.dtype in (torch.float32, torch.float64) else \
            torch.linalg.vector_norm(flat, dtype=torch.float32).square()
        self._squares.append(square.float())

    def flags(self, like: torch.Tensor) -> torch.Tensor:
        """[BAD, LATE] (the module's docstring) when the last bucket starts, on `like`'s device.
        On a GPU the gradients' norms stay on the device (it goes on computing); on the CPU
        they are read, which costs less there than the tensor operations would. A loss
        reported by now is read (a loop that reports it before backward ends syncs here)."""
        loss_bad, late = False, self._reported is None and self._expects_loss
        if self._reported is not None:
            value = float(self._reported.detach().float().reshape(())) if isinstance(self._reported, torch.Tensor) \
                else float(self._reported)
            loss_bad = not math.isfinite(value) or self._losses.is_spike(value)
        judged = self.gradients_judged and self._squares
        total = sum(self._squares[1:], self._squares[0]) if judged else None  # a NaN or inf anywhere: not finite
        if like.device.type == "cpu":
            grads_bad = total is not None and not math.isfinite(float(total))
            return torch.tensor([float(grads_bad or loss_bad), float(late)])
        flags = torch.zeros(NUM_FLAGS, dtype=torch.float32, device=like.device)
        if total is not None:
            flags[BAD] = ~torch.isfinite(total)
        flags[BAD] += float(loss_bad)  # 2 counts as bad as 1
        flags[LATE] = float(late)
        return flags

    def judge(self, loss: torch.Tensor | float | None,
              extra: torch.Tensor | None = None) -> tuple[bool, float | None, float | None, list[float]]:
        """(this rank's step is bad, its loss, its own gradient norm, `extra`'s values): one device read."""
        values = list(self._squares)
        device = values[0].device if values else extra.device if extra is not None else None
        if isinstance(loss, torch.Tensor):
            values.append(loss.detach().float().reshape(()).to(device or loss.device))
        if extra is not None:
            values += list(extra.float().to(device))
        host = torch.stack(values).double().cpu().tolist() if values else []
        rest = host[len(self._squares):]
        host = host[:len(self._squares)]
        loss_value = rest.pop(0) if isinstance(loss, torch.Tensor) else (float(loss) if loss is not None else None)
        norm = math.sqrt(sum(host)) if host else None
        grads_ok = all(math.isfinite(v) for v in host) or not self.gradients_judged
        self.finite = grads_ok and (loss_value is None or math.isfinite(loss_value))
        self.spike = bool(self.finite and loss_value is not None and self._losses.is_spike(loss_value))
        return (not self.finite or self.spike), loss_value, norm, rest

    def decide(self, loss, ftar, contributes: bool, device: torch.device) -> tuple[bool, float | None, float | None]:
        """(some member's step is bad, this rank's loss, its own gradient norm). Across
        replicas from the flags that came with the exchange (ftar.flag_sums), and with
        `ftar.agree` where a member may have judged a loss only since, or no flags came; the
        caller agrees on it across the replica's ranks (Commit.vote, in the collective of its
        own vote). A replica that contributes nothing (it catches up) cannot make anyone
        skip: it sends zeros, flags included."""
        sums = ftar.flag_sums
        bad, loss_value, norm, summed = self.judge(loss, sums)
        folded_bad, late = (summed[BAD] > 0, summed[LATE] > 0) if sums is not None else (False, True)
        # Every member read the same sums: all of them take the agreement, or none does.
        anyone = folded_bad or (late and ftar.agree(bad and contributes, device))
        self._ever_reported = self._ever_reported or loss is not None
        self._expects_loss = self._ever_reported
        return anyone, loss_value, norm

    def learn(self, loss: float | None) -> None:
        """A loss that was applied (not a spike) joins the history spikes are judged by."""
        if loss is not None and self.finite and not self.spike:
            self._losses.add(loss)

    def fingerprint_due(self, committed_step: int) -> bool:
        k = self.settings.fingerprint_interval
        return k > 0 and (committed_step + 1) % k == 0

    # --- after the step ------------------------------------------------------------------------
    def committed(self, step: int, busy_s: float, loss: float | None, norm: float | None, recovering: bool,
                  serving: bool, skipped: bool, held: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
                  batch_share: float | None, last: bool = False,
                  print_later: concurrent.futures.Future[int] | None = None, input_digest: int | None = None) -> None:
        """This rank's row of a committed step: its busy time, workload, loss, norm, its input's
        digest if it took one, and every `fingerprint_interval` steps or at the job's `last`
        step the fingerprint of the state `held` (model and optimizer; None: it still catches
        up, its state is not the job's). Where a joiner's snapshot of this step was taken,
        `print_later` sums that fingerprint in the background (ft/state_print.py): the row is
        written once it is there."""
        if not skipped:
            self.learn(loss)
        later = print_later if held is not None else None
        print_ = None
        if held is not None and later is None and (self.fingerprint_due(step) or last):
            print_ = int(fingerprint(state_tensors(held[0].parameters(), held[1])).item())
        tokens, sum_len_sq = self._workload
        # A replica still catching up trains a stale copy: its loss says nothing. Recovery work
        # (serving or fetching state) makes the step longer than its workload says.
        row = Signal(step=step, replica=self.replica, rank=self.rank, step_seconds=round(busy_s, 6),
                     tokens=tokens, sum_len_sq=sum_len_sq, loss=None if recovering else loss, grad_norm=norm,
                     finite=self.finite, fingerprint=print_, recovery=recovering or serving,
                     batch_share=batch_share, input_digest=input_digest)
        self._flush_held()
        if later is not None:
            self._held.append((row, later))
        else:
            self._write(row)

    def _flush_held(self, wait_s: float = 0.0) -> None:
        """Write the held rows whose fingerprint was summed (waiting up to `wait_s` for each):
        one whose sum failed, or did not come within `wait_s` where it was waited for, goes
        without it."""
        keep = []
        for row, later in self._held:
            try:
                row = dataclasses.replace(row, fingerprint=later.result(timeout=wait_s))
            except concurrent.futures.TimeoutError:
                if not wait_s:
                    keep.append((row, later))
                    continue
            except Exception:  # PrintLater logged it; the row goes without
                pass
            self._write(row)
        self._held = keep

    def _write(self, row: Signal) -> None:
        if self._file is not None:
            write_trace([row], self._file, header=False)

    def close(self) -> None:
        self._flush_held(wait_s=30.0)
        COUNTER.detach()
        if self._waiting is not None:
            self._waiting.close()
            self._waiting = None
        if self._stacks is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stacks.close()
            self._stacks = None
        if self._file is not None:
            self._file.close()
            self._file = None


def signals_dir() -> str | None:
    from transom.contract import ENV_SIGNALS_DIR

    return os.environ.get(ENV_SIGNALS_DIR) or None
