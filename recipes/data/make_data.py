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


def main():
    rng = random.Random(1234)
    held = words(rng, 400)
    train = words(rng, 6000, exclude=held)
    # quickstart: reverse a word (the model is trained from scratch)
    task(HERE / "reverse", train, held, "reverse", lambda w: w[::-1])
    # quickstart-lora: a new task for the reverse model: copy the word unchanged
    rng = random.Random(99)
    held = words(rng, 400)
    train = words(rng, 3000, exclude=held)
    task(HERE / "copy", train, held, "copy", lambda w: w)


def task(folder, train, held, verb, answer):
    """train/valid/test.jsonl of {"prompt": "VERB word =", "completion": " ANSWER"}."""
    folder.mkdir(exist_ok=True)
    for name, ws in (("train", train), ("valid", held[:200]), ("test", held[200:])):
        write(
            folder / f"{name}.jsonl",
            [{"prompt": f"{verb} {w} =", "completion": f" {answer(w)}"} for w in ws],
        )


if __name__ == "__main__":
    main()
