"""A split encoded by several processes is the split one process encodes: the same examples in
the same order, the same bad rows named, the same stats."""

import json
import os
from pathlib import Path

import pytest
from test_tool_calls import QWEN_STYLE

from mlxtune.data import BadRows, Encoder, load_split
from mlxtune.data import parallel as E
from mlxtune.errors import UserInputError


def rows(n, bad_at=()):
    out = []
    for i in range(n):
        if i in bad_at:
            out.append({"messages": [{"role": "user", "content": "no answer"}]})  # untrainable
            continue
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"say {i} twice"},
                    {"role": "assistant", "content": f"{i} {i}"},
                ]
            }
        )
    return out


def write(tmp_path, data):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


@pytest.fixture
def enc(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    return Encoder(load_tokenizer(tokenizer_dir, chat_template=QWEN_STYLE))


def test_two_processes_encode_what_one_does(tmp_path, enc, monkeypatch):
    monkeypatch.setattr(E, "_CHUNK_ROWS", 9)  # several chunks a process
    path = write(tmp_path, rows(40, bad_at={5, 31}))

    def load(num_proc):
        return load_split(path, enc, "auto", 512, "truncate", 2, None, BadRows(True, 0.5), num_proc)

    seen = []
    one = load(1)
    with E.reporting(lambda *a: seen.append(a)):
        two = load(2)
    assert seen[0] == ("encoding chat.jsonl", 0, 40) and seen[-1] == ("encoding chat.jsonl", 40, 40)
    assert len(seen) == 1 + 5  # one report a chunk of 9 rows
    assert [(e.ids, e.mask, e.prompt, e.prompt_ids, e.answer) for e in two.examples] == [
        (e.ids, e.mask, e.prompt, e.prompt_ids, e.answer) for e in one.examples
    ]
    assert len(one.examples) == 38 and one.stats == two.stats
    assert two.stats.skipped == 2 and any("chat.jsonl:6:" in s for s in two.stats.skipped_rows)
    with pytest.raises(UserInputError, match=r"chat.jsonl:6: the conversation has no assistant"):
        load_split(path, enc, "auto", 512, "truncate", 2, None, BadRows(), 2)


def test_auto_uses_several_processes_only_for_large_splits(monkeypatch):
    monkeypatch.setattr(E.os, "cpu_count", lambda: 12)
    assert E.workers_for(E.PARALLEL_ROWS - 1, "auto") == 1
    assert E.workers_for(E.PARALLEL_ROWS, "auto") == 8
    assert E.workers_for(10, 3) == 3


def test_a_script_with_no_main_guard_encodes_in_several_processes(tmp_path, tokenizer_dir):
    """Workers start from a fresh interpreter: a script that encodes at its top level (no
    ``if __name__ == "__main__":``) does not run again in them, and finishes."""
    import subprocess
    import sys

    path = write(tmp_path, rows(30))
    script = tmp_path / "script.py"
    script.write_text(
        "from pathlib import Path\n"
        "from test_tool_calls import QWEN_STYLE\n"
        "from mlxtune.data import Encoder, load_split\n"
        "from mlxtune.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(tokenizer_dir)!r}, chat_template=QWEN_STYLE)\n"
        f"ds = load_split(Path({str(path)!r}), Encoder(tok), 'auto', 512, 'truncate', 2, num_proc=2)\n"
        "print('encoded', len(ds.examples))\n"
    )
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": tests},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "encoded 30"


def test_preference_pairs_and_prompts_encode_alike_in_two_processes(
    tmp_path, tokenizer_dir, monkeypatch
):
    """load_pairs and load_prompts hand rows to processes as load_split does: the same pairs,
    prompts (offline responses too), bad rows and stats as one process."""
    from mlxtune.data.preference import PairEncoder, load_pairs
    from mlxtune.data.prompts import PromptEncoder, load_prompts
    from mlxtune.tokenizer import load_tokenizer

    monkeypatch.setattr(E, "_CHUNK_ROWS", 7)
    tok = load_tokenizer(tokenizer_dir, chat_template=QWEN_STYLE)
    pairs = [
        {"prompt": f"pick {i}", "chosen": f" {i}", "rejected": f" {i + 1}" + " and more" * (i % 4)}
        for i in range(30)
    ]
    pairs[4] = {"prompt": "no pair here", "chosen": " x"}  # bad: no rejected
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs))

    def load_p(num_proc):
        return load_pairs(
            path, PairEncoder(tok), "auto", (12, "drop", 2), None, BadRows(True, 0.5), num_proc
        )

    one, two = load_p(1), load_p(2)

    def fields(d):
        return [(e.ids, e.mask, e.rejected_ids, e.rejected_mask, e.index) for e in d.examples]

    assert fields(two) == fields(one) and one.stats == two.stats
    assert one.stats.skipped == 1 and one.stats.dropped_too_long > 0  # long ones dropped alike

    prompts = [
        {"prompt": [{"role": "user", "content": f"count to {i}" + " more" * (i % 5)}],
         "responses": [f"{i}", "no"], "rewards": [1.0, 0.0], "answer": i}
        for i in range(25)
    ]  # fmt: skip
    prompts[9] = {"prompt": "text", "responses": ["a"]}  # bad: no rewards
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts))

    def load_q(num_proc):
        enc = PromptEncoder(tok)
        return load_prompts(path, enc, 24, 4, "truncate", None, BadRows(True, 0.5), num_proc)

    one, two = load_q(1), load_q(2)

    def fields(d):  # noqa: F811 - the prompts' fields
        return [
            (e.ids, e.prompt, e.answer, e.fields, e.where, e.responses, e.ended, e.rewards)
            for e in d.examples
        ]

    assert fields(two) == fields(one) and one.stats == two.stats
    assert one.stats.skipped == 1 and one.stats.truncated > 0 and len(one.examples) == 24
