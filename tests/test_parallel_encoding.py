"""A split encoded by several processes is the split one process encodes: the same examples in
the same order, the same bad rows named, the same stats."""

import json

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
