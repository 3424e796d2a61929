"""A worker that writes how it was started, then trains as the tiny GPT example (argv passed on).

One JSON line per worker start into $WARM_PROBE_OUT: whether torch was already imported
before this script's first line (a warm start), its `__name__`, argv, working directory,
`sys.path[0]`, its session, and a draw of numpy's and `random`'s global generators.
"""

import json
import os
import random
import runpy
import sys

record = {
    "warm": "torch" in sys.modules,
    "name": __name__,
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "session_leader": os.getsid(0) == os.getpid(),
    "pid": os.getpid(),
    "parent": os.getppid(),
    "attempt": os.environ.get("TRANSOM_ATTEMPT"),
    "rank": os.environ.get("RANK"),
    "random": random.random(),
}
import numpy  # noqa: E402  (after the record: its import must not decide "warm")

record["numpy"] = float(numpy.random.random())
with open(os.environ["WARM_PROBE_OUT"], "a") as f:
    f.write(json.dumps(record) + "\n")

example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "train_tiny_gpt.py")
sys.argv = [example, *sys.argv[1:]]
runpy.run_path(example, run_name="__main__")
