"""The comparison benchmarks' torchft 0.2.0 worker: torchft's manual loop (Manager, a Gloo
process group, `manager.allreduce` of every gradient, `should_commit` before the step).

Environment (set by benchmarks/_replicas.py): REPLICA_ID, TORCHFT_LIGHTHOUSE, BENCH_OUT,
BENCH_KILL_STEP (the first incarnation SIGKILLs itself in the forward pass of that step),
BENCH_ATTEMPT, BENCH_HOST (the address to advertise; default 127.0.0.1).
"""

import time

STARTED = time.time()  # before the imports: the restart cost includes them

import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, Workload, setup  # noqa: E402

IMPORTED = time.time()


def main() -> None:
    args = setup()
    replica = int(os.environ["REPLICA_ID"])
    kill_step = int(os.environ.get("BENCH_KILL_STEP", "-1")) if os.environ.get("BENCH_ATTEMPT") == "0" else -1
    work = Workload(args.model)
    model, opt = work.model, work.optimizer()
    built = time.time()
    host = os.environ.get("BENCH_HOST", "127.0.0.1")  # this replica's address (its namespace's, with --network netns)
    if "BENCH_HOST" in os.environ:
        # torchft advertises its checkpoint server as http://<gethostname()>:port, as in a
        # pod whose host name resolves to its own address; in a network namespace of this
        # machine the name resolves to loopback, so the address stands in for it.
        socket.gethostname = lambda: host
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, replica_id=f"replica_{replica}",
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], store_addr=host, store_port=store.port, hostname=host,
        rank=0, world_size=1, init_sync=False, timeout=timedelta(seconds=30),
    )
    log = StepLog("torchft", replica, STARTED, imported=IMPORTED, built=built, joined=time.time())
    try:
        last = time.time()
        while manager.current_step() < args.steps:
            manager.start_quorum()
            opt.zero_grad(set_to_none=True)
            if manager.current_step() == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # in the forward pass of that step
            work.loss(replica, manager.current_step()).backward()
            works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
            for w in works:
                w.wait()
            contributing = manager.is_participating()
            committed = manager.should_commit()
            if committed:
                opt.step()
            now = time.time()
            log.step(manager.current_step(), now, now - last, committed, committed and contributing)
            last = now
    finally:
        log.close()
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
