"""Regenerate the small task datasets that the quickstart recipes train on.

    python recipes/data/make_data.py

Deterministic: the same files every time. Held-out words never appear in training data.
"""

import calendar
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
    # smollm2-lora: write an ISO date in words, as chat (a real chat model answers in its own
    # words before fine-tuning); train, valid and test hold different dates
    dates(HERE / "dates", random.Random(0))


DATE_QUESTIONS = (
    "Write the date {iso} in words.",
    "How is {iso} written out in words?",
    "Spell out the date {iso}.",
)


def dates(folder, rng):
    """train/valid/test.jsonl of chat: "Write the date 2023-04-05 in words." -> "April 5, 2023"."""
    folder.mkdir(exist_ok=True)
    seen = set()

    def row():
        while True:
            y, m = rng.randint(1900, 2099), rng.randint(1, 12)
            d = rng.randint(1, calendar.monthrange(y, m)[1])
            if (y, m, d) not in seen:
                seen.add((y, m, d))
                break
        question = rng.choice(DATE_QUESTIONS).format(iso=f"{y:04d}-{m:02d}-{d:02d}")
        answer = f"{calendar.month_name[m]} {d}, {y}"
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        }

    for name, n in (("train", 800), ("valid", 40), ("test", 60)):
        write(folder / f"{name}.jsonl", [row() for _ in range(n)])


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
