"""What samples and exact-match rows show as the prompt: the user's message (chat data), the
prompt, or the instruction, with the whole templated prompt kept under ``prompt_text``; answers
decoded without special tokens. Checked on a tiny chat run whose template adds a system prompt
and ``<|im_start|>``/``<|im_end|>`` markers, as SmolLM2's does, through samples.jsonl, the
console, the dashboard, exact_match_*.json and a resumed run."""

import asyncio
import io
import json
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import LETTERS, make_crash, tiny_arch, tiny_recipe, write_jsonl
from mlxtune import Trainer, recipe_from_dict
from mlxtune.config import SamplesConfig
from mlxtune.console import Console
from mlxtune.data import Dataset, Encoder
from mlxtune.evaluate import exact_match, sample

SYSTEM = "You are a helpful AI assistant named Tiny"
# SmolLM2-Instruct's template: a default system turn unless the conversation has its own.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARKERS = ["<|im_start|>", "<|im_end|>"]


def templated(messages) -> str:
    """The template above, written out by hand: what the model reads before its answer."""
    out = "" if messages[0]["role"] == "system" else f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def chat_tokenizer(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir, chat_template=TEMPLATE)
    tok._tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny llama whose tokenizer has the markers as special tokens and the template above."""
    from mlxtune.models import build_model, save_model

    tok = chat_tokenizer(tokenizer_dir)
    out = tmp_path_factory.mktemp("chat-model")
    model, config = build_model(tiny_arch("llama"), len(tok._tokenizer), seed=3)
    save_model(model, config, out, tok)
    return out


def chat_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"reverse {w} ="},
                    {"role": "assistant", "content": w[::-1]},
                ]
            }
        )
    return rows


def held_out_rows(seed):
    """First rows with a second turn, their own system prompt, and brackets Rich would read
    as markup; the user message shown is the last one before the last answer."""
    rows = chat_rows(4, seed)
    rows[0]["messages"] = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        *rows[0]["messages"],
    ]
    rows[1]["messages"] = [{"role": "system", "content": "be brief"}, *rows[1]["messages"]]
    rows[2]["messages"][0]["content"] = "reverse [b]abc[/b] [/INST] ="
    return rows


def last_user_and_prompt(row):
    """(the last user message, the messages before the last assistant turn), from the row."""
    msgs = row["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    users = [m["content"] for m in msgs[:last] if m["role"] == "user"]
    return users[-1], msgs[:last]


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_chat_run_shows_the_users_message_and_keeps_the_templated_prompt(
    tmp_path, chat_model_dir
):
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", chat_rows(32, seed=1))
    write_jsonl(data / "valid.jsonl", held_out_rows(seed=2))
    write_jsonl(data / "test.jsonl", held_out_rows(seed=3))
    r = tiny_recipe(
        data,
        chat_model_dir,
        train={"batch_size": 8, "max_steps": 4, "log_every": 2, "progress": False},
        eval={"every": 2, "exact_match": 3, "max_new_tokens": 4},
        samples={"every": 2, "count": 3, "max_new_tokens": 4},
        checkpoints={"every": 2},
    )
    r["data"].update(test=str(data / "test.jsonl"), format="chat", max_length=256)
    run = tmp_path / "run"
    first, second = io.StringIO(), io.StringIO()
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(
            recipe_from_dict(r), run, console=Console(stream=first), callbacks=[make_crash(2)]
        ).run()
    Trainer(recipe_from_dict(r), run, console=Console(stream=second), resume="latest").run()

    valid = [json.loads(x) for x in (data / "valid.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (data / "test.jsonl").read_text().splitlines()]

    # samples.jsonl: the first three validation examples at steps 2 (before the crash) and 4
    samples = read_rows(run / "samples.jsonl")
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4]
    for i, s in enumerate(samples):
        user, before = last_user_and_prompt(valid[i % 3])
        assert s["prompt"] == user
        assert s["prompt_text"] == templated(before)
        assert not any(m in s["completion"] for m in MARKERS)
    assert "be brief" in samples[1]["prompt_text"] and SYSTEM not in samples[1]["prompt_text"]

    # the console's sample line shows the user's message, not the template
    user, _ = last_user_and_prompt(valid[0])
    for out, step, s in ((first, 2, samples[0]), (second, 4, samples[3])):
        lines = [x for x in out.getvalue().splitlines() if x.startswith("sample @")]
        assert lines == [f"sample @ {step}: {user!r} -> {s['completion']!r}"]

    # exact_match_*.json: the test split's user messages, the templated prompt kept apart
    for when in ("untrained", "trained"):
        rows = json.loads((run / f"exact_match_{when}.json").read_text())
        assert len(rows) == 3
        for row, data_row in zip(rows, test[:3], strict=True):
            user, before = last_user_and_prompt(data_row)
            assert row["prompt"] == user
            assert row["prompt_text"] == templated(before)
            assert row["reference"] == data_row["messages"][-1]["content"]
            assert not any(m in row["answer"] for m in MARKERS)

    # the dashboard's samples panel: the last row's user message, brackets and all
    from textual.widgets import Static

    from mlxtune.tui.app import WatchApp

    async def shown():
        app = WatchApp(run, read_only=True, poll_s=0.05)
        async with app.run_test(size=(200, 40)) as pilot:
            await pilot.pause()
            return str(app.query_one("#sample", Static).render())

    text = asyncio.run(shown())
    user, _ = last_user_and_prompt(valid[2])
    assert user == "reverse [b]abc[/b] [/INST] ="
    assert text == f"sample @ 4: {user!r} → {samples[-1]['completion']!r}"


class Scripted(nn.Module):
    """A "model" that follows a fixed script whatever the prompt: after the script's token i comes
    token i + 1, after any other token the script's first (its tokens are distinct). The next
    token is a function of the input, so compiled decode steps follow it too."""

    def __init__(self, script, vocab):
        super().__init__()
        assert len(set(script)) == len(script)
        table = np.full(vocab, script[0], np.int32)
        for a, b in zip(script[:-1], script[1:], strict=True):
            table[a] = b
        self._vocab = vocab
        self.freeze()
        self.table = mx.array(table)

    def make_cache(self):
        return []

    def __call__(self, x, cache=None):
        return (mx.arange(self._vocab) == self.table[x][..., None]).astype(mx.float32) * 10


def test_answers_are_decoded_without_special_tokens_and_end_at_eos(tokenizer_dir):
    tok = chat_tokenizer(tokenizer_dir)
    start, end = (tok._tokenizer.convert_tokens_to_ids(m) for m in MARKERS)
    word = list(tok.encode("cba", add_special_tokens=False))
    after = [t for t in tok.encode("xyz", add_special_tokens=False) if t not in word]
    # a marker, the answer, a marker, then eos and text that must not be read
    model = Scripted([end, *word, start, tok.eos_token_id, *after], len(tok._tokenizer))
    row = {"messages": [{"role": "user", "content": "reverse abc ="}]}
    row["messages"].append({"role": "assistant", "content": "cba"})
    ex = Encoder(tok).encode(row, "chat", "f:1")
    assert ex.prompt == templated(row["messages"][:1])

    cfg = SamplesConfig(every=1, count=1, max_new_tokens=16)
    (s,) = sample(model, tok, cfg, Dataset([ex]), step=1)
    assert s == {"prompt": "reverse abc =", "prompt_text": ex.prompt, "completion": "cba"}

    acc, rows = exact_match(model, tok, [ex], max_new_tokens=16)
    assert acc == 1.0
    assert rows == [
        {
            "prompt": "reverse abc =",
            "prompt_text": ex.prompt,
            "answer": "cba",
            "reference": "cba",
            "correct": True,
        }
    ]

    # a recipe's own prompts are shown, and read, as written
    cfg = SamplesConfig(every=1, prompts=["reverse xyz ="], max_new_tokens=16)
    (s,) = sample(model, tok, cfg, Dataset([]), step=1)
    assert s == {"prompt": "reverse xyz =", "prompt_text": "reverse xyz =", "completion": "cba"}


@pytest.mark.parametrize(
    "fmt, row, shown",
    [
        ("completion", {"prompt": "reverse abc =", "completion": " cba"}, "reverse abc ="),
        ("instruction", {"instruction": "say hi", "output": "hi"}, "say hi"),
        (
            "instruction",
            {"instruction": "say hi", "input": "to bob", "output": "hi bob"},
            "say hi\nto bob",
        ),
        (
            "chat",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "hi"},
                    {"role": "user", "content": "bye"},
                    {"role": "assistant", "content": "good bye"},
                ]
            },
            "bye",
        ),
        ("text", {"text": "plain text"}, None),
    ],
)
def test_each_format_carries_a_short_display_of_its_prompt(tokenizer_dir, fmt, row, shown):
    tok = chat_tokenizer(tokenizer_dir)
    ex = Encoder(tok).encode(row, fmt, "f:1")
    assert ex.display == shown
    if "messages" in row:  # the model still reads the whole templated prompt
        assert ex.prompt == templated(row["messages"][:-1])
        assert ex.prompt_ids == list(
            tok._tokenizer.apply_chat_template(
                row["messages"][:-1], add_generation_prompt=True, return_dict=False
            )
        )
    elif "instruction" in row:
        assert ex.prompt.startswith("### Instruction:\nsay hi\n\n")
