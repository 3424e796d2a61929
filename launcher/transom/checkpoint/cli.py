"""`transom checkpoint export STEP --to FILE`: a committed checkpoint as a plain PyTorch file.

The command's arguments and its error handling; the work is export.py's. Every failure a
user can cause or meet (no such step, a checkpoint whose bytes do not match its manifest,
storage that cannot be read, a destination that cannot be written) is one line on stderr
and exit code 2, with no traceback and no destination file. This module imports nothing
heavy at the top (`transom.cli` builds its parser where torch is absent); torch is imported
when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from transom import contract

_PROG = "transom checkpoint export"
_DESCRIPTION = """\
Write the model state dict of a committed checkpoint as a plain dict of whole
CPU tensors, saved with torch.save, so that torch.load(FILE, weights_only=True)
reads it. The checkpoint is verified against its manifest as a restore verifies
it, and a sharded (FSDP2) one is joined into whole tensors. The names are those
of the training script's model.state_dict(), wrapper prefixes included (see
--strip-prefix). The file is written whole or not at all; any failure is one
line on stderr and exit code 2.
"""
_EXAMPLES = """\
examples:
  transom checkpoint export latest --uri /mnt/ckpt/job --to model.pt
  transom checkpoint export 2000 --uri s3://bucket/job --to ckpt.pt --include-optimizer
  transom checkpoint export latest --uri ckpt --to model.pt --strip-prefix module.

then, in any script:
  state_dict = torch.load("model.pt", weights_only=True)
  model.load_state_dict(state_dict)
"""


def step_number(text: str) -> int | None:
    """An argparse type: `latest` (None) or a step number."""
    if text == "latest":
        return None
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is neither a step number nor 'latest'") from None
    if not 0 <= step < 10**12:
        raise argparse.ArgumentTypeError(f"a step is from 0 to 10^12 - 1, got {step}")
    return step


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="checkpoint_cmd", required=True)
    e = sub.add_parser(
        "export", help="write a committed checkpoint's model weights as a plain PyTorch file",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLES,
        description=_DESCRIPTION)
    e.add_argument("step", type=step_number, metavar="STEP", help="a committed step number, or 'latest' (the newest)")
    e.add_argument("--to", required=True, metavar="FILE", help="the file to write (replaced if it exists)")
    e.add_argument("--uri", help="the checkpoint location: a directory or s3://bucket/prefix, as given to "
                                 f"`transom run --checkpoint-uri` or spec.checkpoint.uri (default: "
                                 f"${contract.ENV_CHECKPOINT_URI}); S3 credentials from the AWS variables")
    e.add_argument("--include-optimizer", action="store_true",
                   help='write {"model": ..., "optimizer": ..., "step": N} instead of the model state dict alone '
                        "(the optimizer's state_dict(), as plain dicts, lists, numbers and tensors)")
    e.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                   help="take PREFIX off the names that start with it, e.g. 'module.' (DDP) or '_orig_mod.' "
                        "(torch.compile); repeatable, applied in order")


def main(args: argparse.Namespace) -> int:
    uri = args.uri or os.environ.get(contract.ENV_CHECKPOINT_URI, "")
    if not uri:
        print(f"{_PROG}: no checkpoint location: pass --uri DIR|s3://... (or set {contract.ENV_CHECKPOINT_URI})",
              file=sys.stderr)
        return contract.EXIT_USAGE
    if "://" not in uri:
        uri = os.path.abspath(uri)  # as `transom run --checkpoint-uri` takes a directory
    from transom.checkpoint.export import export
    from transom.errors import TransomError

    try:
        step, obj = export(uri, args.step, args.to, args.include_optimizer, args.strip_prefix)
    except (TransomError, OSError, ValueError, ImportError) as e:  # ImportError: no s3fs for an s3:// URI
        print(f"{_PROG}: {_one_line(e)}", file=sys.stderr)
        return contract.EXIT_USAGE
    model = obj["model"] if args.include_optimizer else obj
    tensors = [v for v in model.values() if hasattr(v, "nbytes")]
    size = sum(t.nbytes for t in tensors)
    what = " and the optimizer's state" if args.include_optimizer else ""
    print(f"wrote step {step}'s model ({len(tensors)} tensors, {size / 2**20:.1f} MiB){what} to {args.to}")
    return contract.EXIT_OK


def _one_line(e: BaseException) -> str:
    """The error's message on one line (an OSError's without its "[Errno N]")."""
    text = str(e)
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror + (f": {e.filename}" if e.filename else "")
    return " ".join(text.split())
