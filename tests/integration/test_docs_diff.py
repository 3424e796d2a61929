"""The diffs in docs/training-api.md are code that works.

- The `+` side of the DDP diff, taken from the page as written, given a dataset, a model and
  a loss, trains two replicas of two DDP processes each through a real SIGKILL, the replicas
  end bit-identical, and the ranks of a replica agree (the exchange at the end of backward
  ran after DDP's own reduction). The job ends a few steps after the killed replica caught
  up (`--end-on`); the page's step count is only a cap.
- The nanoGPT diff is `diff -u` of the two files of examples/nanogpt_style/ as they are now
  (test_nanogpt_style.py runs both), so an edit to either file that the page does not
  follow fails here.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "training-api.md"
NANOGPT = ROOT / "examples" / "nanogpt_style"

# What the page leaves to the reader: a dataset, a model, a loss and the number of steps.
PREAMBLE = '''
import torch
from torch.utils.data import TensorDataset

g = torch.Generator().manual_seed(0)
_x = torch.randn(2048, 8, generator=g)
dataset = TensorDataset(_x, (_x @ torch.randn(8, 1, generator=g)).squeeze(1).gt(0).long())
num_steps = 3000  # a cap: the test ends the job once the killed replica caught up
loss_fn = torch.nn.functional.cross_entropy
torch.set_num_threads(1)


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
'''

# After the page's code: every rank of the replica holds the same parameters.
POSTAMBLE = '''
import hashlib
import torch.distributed as dist

digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
digests = [None] * dist.get_world_size()
dist.all_gather_object(digests, digest)
assert len(set(digests)) == 1, digests
print(f"replica {ctx.replica_id} rank {ctx.rank}: ranks agree", flush=True)
'''


def after_side() -> str:
    block = re.search(r"## From a DDP script.*?```diff\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/training-api.md lost its DDP diff"
    lines = [line[1:] if line[:1] in "+ " else None for line in block.group(1).splitlines()]
    return "\n".join(line for line in lines if line is not None) + "\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_after_side_of_the_ddp_diff_survives_a_sigkill(transom_run, tmp_path):
    code = after_side()
    assert "ft.FaultTolerant" in code and "DistributedSampler" not in code
    script = tmp_path / "train.py"
    script.write_text(PREAMBLE + code + POSTAMBLE)
    result = transom_run(["--replicas", "2", "--nproc-per-replica", "2", "--inject", "kill:replica=1,step=20",
                          "--end-on", "caught_up:1"], [], script=script, timeout_s=280)
    result.assert_finished_together(2)
    assert result.summary["replica_restarts"] >= 1
    assert result.output.count("ranks agree") >= 4, result.output[-3000:]


def _docstring_end(path: Path) -> int:
    """The last line of the module's docstring."""
    first = ast.parse(path.read_text()).body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), f"{path} has no docstring"
    assert first.end_lineno is not None
    return first.end_lineno


def nanogpt_diff() -> str:
    """`diff -u train_ddp.py train.py` of examples/nanogpt_style/, without the hunks that only
    change the module docstrings (the page trims them)."""
    before, after = NANOGPT / "train_ddp.py", NANOGPT / "train.py"
    proc = subprocess.run(["diff", "-u", "--label", before.name, "--label", after.name, str(before), str(after)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr  # 1: the files differ
    ends = {"-": _docstring_end(before), "+": _docstring_end(after)}
    header, *hunks = re.split(r"^(?=@@ )", proc.stdout, flags=re.M)

    def in_docstrings(hunk: str) -> bool:
        at = re.match(r"@@ -(\d+)(?:,\d+)? \+(\d+)", hunk)
        assert at, hunk
        old, new = map(int, at.groups())
        line = {"-": old, "+": new}
        for text in hunk.splitlines()[1:]:
            if text[:1] in "-+" and line[text[0]] > ends[text[0]]:
                return False
            for side in "-+":
                line[side] += text[:1] in (" ", side)
        return True

    return header + "".join(h for h in hunks if not in_docstrings(h))


def test_the_nanogpt_diff_is_the_diff_of_the_two_example_files():
    block = re.search(r"## Porting a nanoGPT-style script.*?```diff\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/training-api.md lost its nanoGPT diff"
    expected = nanogpt_diff()
    assert block.group(1) == expected, "the page's nanoGPT diff is stale; paste this:\n" + expected
