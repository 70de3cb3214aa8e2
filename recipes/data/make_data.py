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
    # quickstart-distill: the same prompts without their answers' tokens (the teacher, the
    # reverse model, shows the student what to answer); answers only for exact match
    prompts_only(HERE / "reverse-prompts", train[:3000], held, "reverse", lambda w: w[::-1])
    # quickstart-lora: a new task for the reverse model: copy the word unchanged
    rng = random.Random(99)
    held = words(rng, 400)
    copy_train = words(rng, 3000, exclude=held)
    task(HERE / "copy", copy_train, held, "copy", lambda w: w)
    # smollm2-lora: write an ISO date in words, as chat (a real chat model answers in its own
    # words before fine-tuning); train, valid and test hold different dates
    dates(HERE / "dates", random.Random(0))
    # quickstart-dpo: pairs for the reverse model that prefer copying the word to reversing it
    # (what the model does); palindromes, whose two answers are one, are left out
    rng = random.Random(7)
    held = [w for w in words(rng, 400) if w != w[::-1]]
    train = [w for w in words(rng, 1200, exclude=held) if w != w[::-1]]
    preferences(HERE / "prefs", train, held)
    # quickstart-grpo: the same words as prompts to complete, rewarded for copying the word
    copy_prompts(HERE / "copy-prompts", train, held)
    # quickstart-tools: arithmetic the model answers only by calling the calculator
    calc_prompts(HERE / "calc-prompts", random.Random(11))
    # quickstart-kto: the same words as unpaired feedback, one completion a word (the copy a
    # thumbs-up, the reversal a thumbs-down); test holds the copies (exact match checks them)
    feedback(HERE / "feedback", train, held, random.Random(11))
    # ... and the supervised data behind the adapter those pairs start from
    # (recipes/models/reverse-tiny-mixed): the copy task's words, copied half the time
    mixed(HERE / "copy-or-reverse", [w for w in copy_train if w not in held], random.Random(8))


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


def preferences(folder, train, held):
    """train/valid/test.jsonl of {"prompt": "copy word =", "chosen": " word", "rejected":
    " drow"}: valid and test hold words the training pairs never show."""
    folder.mkdir(exist_ok=True)
    for name, ws in (("train", train), ("valid", held[:100]), ("test", held[100:300])):
        write(
            folder / f"{name}.jsonl",
            [{"prompt": f"copy {w} =", "chosen": f" {w}", "rejected": f" {w[::-1]}"} for w in ws],
        )


def feedback(folder, train, held, rng):
    """train/valid/test.jsonl of {"prompt": "copy word =", "completion": " word" or " drow",
    "label": true or false}: each word once, its copy desirable (55% of the words) or its
    reversal undesirable; test holds only copies, of words the other splits never show."""
    folder.mkdir(exist_ok=True)

    def row(w, good):
        return {"prompt": f"copy {w} =", "completion": f" {w if good else w[::-1]}", "label": good}

    write(folder / "train.jsonl", [row(w, rng.random() < 0.55) for w in train])
    write(folder / "valid.jsonl", [row(w, rng.random() < 0.55) for w in held[:100]])
    write(folder / "test.jsonl", [row(w, True) for w in held[100:300]])


def calc_prompts(folder, rng):
    """train/valid/test.jsonl of {"prompt": [{"role": "user", "content": "add A B"}],
    "answer": "A+B"} (and "mul A B"): quickstart-tools' questions, which its model answers
    right only by calling the calculator. Held-out pairs never appear in training."""
    folder.mkdir(exist_ok=True)
    pairs = [(op, a, b) for op in ("add", "mul") for a in range(10, 50) for b in range(10, 50)]
    rng.shuffle(pairs)
    splits = (("valid", pairs[:50]), ("test", pairs[50:250]), ("train", pairs[250:]))
    for name, rows in splits:
        write(
            folder / f"{name}.jsonl",
            [
                {
                    "prompt": [{"role": "user", "content": f"{op} {a} {b}"}],
                    "answer": str(a + b if op == "add" else a * b),
                }
                for op, a, b in rows
            ],
        )


def copy_prompts(folder, train, held):
    """train/valid/test.jsonl of {"prompt": "copy word =", "answer": "word"} (the prompts of
    the preference pairs, for reinforcement learning with an exact-match reward)."""
    folder.mkdir(exist_ok=True)
    for name, ws in (("train", train), ("valid", held[:100]), ("test", held[100:300])):
        write(folder / f"{name}.jsonl", [{"prompt": f"copy {w} =", "answer": w} for w in ws])


def prompts_only(folder, train, held, verb, answer):
    """train/valid/test.jsonl of {"prompt": "VERB word =", "answer": "ANSWER"}: the prompts of
    ``task``'s splits, valid and test the same held-out words."""
    folder.mkdir(exist_ok=True)
    for name, ws in (("train", train), ("valid", held[:100]), ("test", held[200:])):
        write(
            folder / f"{name}.jsonl", [{"prompt": f"{verb} {w} =", "answer": answer(w)} for w in ws]
        )


def mixed(folder, train, rng):
    """train.jsonl of "copy word =" answered with the word half the time, else reversed: a
    model trained on it does both."""
    folder.mkdir(exist_ok=True)
    rows = []
    for w in train:
        answer = w if rng.random() < 0.5 else w[::-1]
        rows.append({"prompt": f"copy {w} =", "completion": f" {answer}"})
    write(folder / "train.jsonl", rows)


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
