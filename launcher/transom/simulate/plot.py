"""Goodput against cluster size for each strategy, as a PNG (matplotlib, optional).

The preset's per-GPU failure rate and replica size stay; only the number of GPUs (and so of
replicas, and the job's failure rate) changes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from transom.simulate.engine import simulate
from transom.simulate.model import Scenario

SIZES = (1024, 2048, 4096, 8192, 16_384, 32_768, 65_536, 98_304, 131_072)


def curves(scenario: Scenario, seed: int, days: float) -> dict[str, list[tuple[int, float]]]:
    """{strategy: [(gpus, effective training time), ...]} over SIZES (at least one replica)."""
    per_replica = scenario.gpus / scenario.replicas
    out: dict[str, list[tuple[int, float]]] = {}
    for gpus in (g for g in SIZES if g >= per_replica):
        sc = scenario.scaled(gpus)
        sc = type(sc)(**{**sc.__dict__, "days": days})
        for st in sc.strategies:
            out.setdefault(st.title, []).append((gpus, simulate(sc, st, seed).effective))
    return out


def check_writable(path: Path) -> None:
    """ValueError if a PNG could not be written at `path`: checked before the simulation runs,
    so that a typo in the path does not cost the whole run."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(_NO_MATPLOTLIB)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"--plot {path} is a directory, not a file")
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: no directory {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--plot {path}: not writable")


_NO_MATPLOTLIB = "the plot needs matplotlib: .venv/bin/pip install 'matplotlib>=3.8'"


def write_png(path: Path, scenario: Scenario, seed: int, days: float) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(_NO_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for title, points in curves(scenario, seed, days).items():
        ax.plot([g for g, _ in points], [e for _, e in points], marker="o", label=title)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"GPUs (replicas of {round(scenario.gpus / scenario.replicas)} GPUs)")
    ax.set_ylabel("effective training time")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{scenario.name}: {scenario.failures_per_gpu_hour * 1e6:.1f} failures per 10^6 GPU-hours")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
