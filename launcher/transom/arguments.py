"""The argparse types of the subcommands whose settings are not models yet (coordinator,
check, simulate): they reject what no setting could take (nan, inf, a month of seconds)
with argparse's message before anything starts. `transom run` and `transom launch` derive
their flags from their settings models instead (flags.py, launch/config.py).
"""

from __future__ import annotations

import argparse
import math

from transom import contract

MAX_SECONDS = 30 * 86400.0  # a month: a longer wait is a typo (and past ~1e10 s, waits overflow time_t)
MAX_WAIT_S = float(contract.MAX_WAIT_SECONDS)


def _seconds(high: float, zero: bool = False):
    """An argparse type: a finite number of seconds up to `high`, above 0 (or 0 too)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (math.isfinite(value) and (value > 0 or zero and value == 0)):
            raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds{' or 0' if zero else ''}, "
                                             f"got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,.0f} seconds, got {text!r}")
        return value
    return parse


seconds = _seconds(MAX_SECONDS)  # argparse types: no nan, no inf, no 0, nothing past a month
seconds_or_zero = _seconds(MAX_SECONDS, zero=True)
wait_seconds = _seconds(MAX_WAIT_S)


def between(low: int, high: int):
    """An argparse type: an integer from `low` to `high`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also past int()'s 4,300 digits
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value
    return parse
