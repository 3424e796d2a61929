"""The example's data set, nanoGPT's format: `train.bin` and `val.bin`, the token ids of a
text as uint16, read with `np.memmap`. The text is generated from a seeded toy grammar
(no download), a character per token.

    python examples/nanogpt_style/prepare.py --data-dir /tmp/nanogpt-data

The training scripts call `prepare(data_dir)` at their start, so they run without this
step. Every process of a job may call it at once: each writes the same bytes to a file of
its own and renames it into place, so a reader never sees half a file.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np

DETERMINERS = "the a one every some no".split()
NOUNS = "ship sail wind sea harbour captain crew rope deck mast storm gull".split()
ADJECTIVES = "old new dark calm grey swift".split()
VERBS = "turns holds waits pulls rises falls sees finds".split()
PREPOSITIONS = "under over near past".split()
VOCAB = sorted(set(" .\n" + "".join(DETERMINERS + NOUNS + ADJECTIVES + VERBS + PREPOSITIONS)))
"""The characters, in token-id order."""


def sentence(rng: random.Random) -> str:
    """determiner [adjective] noun verb [preposition determiner noun]."""
    def phrase() -> list[str]:
        adjective = [rng.choice(ADJECTIVES)] if rng.random() < 0.4 else []
        return [rng.choice(DETERMINERS), *adjective, rng.choice(NOUNS)]
    words = [*phrase(), rng.choice(VERBS)]
    if rng.random() < 0.6:
        words += [rng.choice(PREPOSITIONS), *phrase()]
    return " ".join(words) + "."


def make_text(num_sentences: int = 8000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    return "\n".join(sentence(rng) for _ in range(num_sentences)) + "\n"


def encode(text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(VOCAB)}
    return np.array([index[c] for c in text], dtype=np.uint16)


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def prepare(data_dir: str) -> None:
    """Write `train.bin` (the first 90% of the text) and `val.bin` into `data_dir` unless
    both are there."""
    paths = {split: os.path.join(data_dir, f"{split}.bin") for split in ("train", "val")}
    if all(os.path.exists(p) for p in paths.values()):
        return
    os.makedirs(data_dir, exist_ok=True)
    ids = encode(make_text())
    n = int(0.9 * len(ids))
    for split, part in (("train", ids[:n]), ("val", ids[n:])):
        tmp = f"{paths[split]}.{os.getpid()}.tmp"
        part.tofile(tmp)
        os.replace(tmp, paths[split])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    prepare(p.parse_args().data_dir)
