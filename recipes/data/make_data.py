"""Regenerate the small task datasets that the quickstart recipes train on.

    python recipes/data/make_data.py

Deterministic: the same files every time. Held-out words never appear in training data.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(rng, n, lo=3, hi=7, exclude=()):
    seen = set(exclude)
    out = []
    while len(out) < n:
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def shift(w):
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in w)


def main():
    rng = random.Random(1234)
    held = words(rng, 400)
    train = words(rng, 6000, exclude=held)
    # quickstart: reverse a word (the model is trained from scratch)
    rev = [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}"} for w in train]
    write(HERE / "reverse" / "train.jsonl", rev)
    write(
        HERE / "reverse" / "valid.jsonl",
        [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}"} for w in held[:200]],
    )
    write(
        HERE / "reverse" / "test.jsonl",
        [{"prompt": f"reverse {w} =", "completion": f" {w[::-1]}"} for w in held[200:]],
    )
    # quickstart-lora: a new task for the reverse model: shift each letter by one
    rng = random.Random(99)
    held = words(rng, 400)
    train = words(rng, 3000, exclude=held)
    write(
        HERE / "shift" / "train.jsonl",
        [{"prompt": f"shift {w} =", "completion": f" {shift(w)}"} for w in train],
    )
    write(
        HERE / "shift" / "valid.jsonl",
        [{"prompt": f"shift {w} =", "completion": f" {shift(w)}"} for w in held[:200]],
    )
    write(
        HERE / "shift" / "test.jsonl",
        [{"prompt": f"shift {w} =", "completion": f" {shift(w)}"} for w in held[200:]],
    )


if __name__ == "__main__":
    main()
