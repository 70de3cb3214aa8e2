"""Encoded data kept on disk: a second run reads its splits from the cache without tokenizing,
and a change to the data, the tokenizer or a setting that shapes encoding is a miss."""

import json

import pytest
from test_resume import trainer

from conftest import tiny_recipe
from mlxtune.data import cache
from mlxtune.data.encode import Dataset, Encoder, Example, SplitStats
from mlxtune.data.preference import PairExample
from mlxtune.data.prompts import PromptExample


@pytest.fixture
def encodes(monkeypatch):
    """How many examples were encoded (Encoder.encode_piece calls) since the last reset."""
    calls = {"n": 0}
    real = Encoder.encode_piece

    def counting(self, piece, where):
        calls["n"] += 1
        return real(self, piece, where)

    monkeypatch.setattr(Encoder, "encode_piece", counting)
    return calls


def splits(t):
    return [
        [(e.ids, e.mask, e.prompt, e.answer, e.prompt_ids, e.display) for e in s.examples]
        for s in (t.train_set, t.valid_set, t.test_set)
    ]


def test_a_second_run_reads_its_splits_from_the_cache(tmp_path, data_dir, llama_dir, encodes):
    r = tiny_recipe(data_dir, llama_dir)
    first = trainer(r, tmp_path / "a")
    assert encodes["n"] > 0
    encodes["n"] = 0
    second = trainer(r, tmp_path / "b")
    assert encodes["n"] == 0  # nothing tokenized
    assert splits(second) == splits(first)
    assert second.train_set.stats.cached and not first.train_set.stats.cached
    assert "from the cache" in second.train_set.stats.line()
    assert first.train_set.stats.line() in second.train_set.stats.line()
    entries = list(cache.cache_root().iterdir())
    assert entries and all(
        sorted(p.name for p in e.iterdir()) == ["meta.json", "tokens.safetensors"] for e in entries
    )


@pytest.mark.parametrize("change", ["data", "tokenizer", "setting"])
def test_a_change_to_the_data_tokenizer_or_settings_is_a_miss(
    tmp_path, data_dir, llama_dir, encodes, change
):
    train = tmp_path / "train.jsonl"
    train.write_bytes((data_dir / "train.jsonl").read_bytes())
    r = tiny_recipe(data_dir, llama_dir)
    r["data"]["train"] = str(train)
    trainer(r, tmp_path / "a")
    encodes["n"] = 0
    trainer(r, tmp_path / "b")
    assert encodes["n"] == 0
    if change == "data":  # one character of one row
        lines = train.read_text().splitlines()
        row = json.loads(lines[5])
        key = next(k for k, v in row.items() if isinstance(v, str))
        row[key] = row[key] + "x"
        lines[5] = json.dumps(row)
        train.write_text("\n".join(lines) + "\n")
    elif change == "tokenizer":
        r["tokenizer"] = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    else:
        r["data"]["max_length"] = 40
    trainer(r, tmp_path / "c")
    assert encodes["n"] > 0


def test_data_cache_false_neither_reads_nor_writes(tmp_path, data_dir, llama_dir, encodes):
    r = tiny_recipe(data_dir, llama_dir)
    r["data"]["cache"] = False
    trainer(r, tmp_path / "a")
    trainer(r, tmp_path / "b")
    assert not cache.cache_root().exists() or not any(cache.cache_root().iterdir())


def test_entries_round_trip_every_kind_of_example(tmp_path):
    examples = [
        Example([1, 2, 3], [0, 1, 1], "p", "a", [1], "shown"),
        Example([4, 5], [0, 1]),
    ]
    pairs = [PairExample([1, 2], [0, 1], rejected_ids=[1, 3, 4], rejected_mask=[0, 1, 1], index=0)]
    prompts = [
        PromptExample(
            [7, 8], [0, 0], prompt_ids=[7, 8], fields={"answer": "4", "n": [1, 2]}, where="f:1",
            responses=[[9, 2], [10]], response_texts=["x", "y"], rewards=[1.0, 0.5],
            ended=[True, False],
        )
    ]  # fmt: skip
    kinds = (Example, PairExample, PromptExample)
    for i, ex in enumerate((examples, pairs, prompts)):
        stats = SplitStats(examples=len(ex) + 1, kept=len(ex), truncated=1, skipped_rows=["l"])
        ds = Dataset(ex, stats, "data.jsonl")
        cache.save(tmp_path / str(i), ds)
        back = cache.load(tmp_path / str(i), kinds)
        assert list(back.examples) == ex and back.path == "data.jsonl"
        assert back.stats.truncated == 1 and back.stats.skipped_rows == ["l"]
    assert [type(b) for b in back.examples[0].ended] == [bool, bool]  # bools stay bools


def test_cached_examples_are_columns_built_as_they_are_read(tmp_path):
    """SFT examples come back as an ExampleTable: each read builds the example from its slices;
    lengths, target counts, picks and slices without building any, equal to the lists'."""
    import random

    from mlxtune.data.encode import ExampleTable, split_sets

    rng = random.Random(0)
    examples = []
    for i in range(40):
        n = rng.randint(2, 9)
        ids = [rng.randrange(1000) for _ in range(n)]
        mask = [rng.randint(0, 1) for _ in range(n)]
        mask[-1] = 1
        with_prompt = i % 3 == 0
        examples.append(
            Example(ids, mask, "p" if with_prompt else None, None, ids[:1] if with_prompt else None)
        )
    stats = SplitStats(examples=40, kept=40)
    cache.save(tmp_path / "e", Dataset(examples, stats, "d.jsonl"))
    back = cache.load(tmp_path / "e", (Example,))
    table = back.examples
    assert isinstance(table, ExampleTable) and len(table) == 40
    assert table[5] == examples[5] and table[-1] == examples[-1]
    assert table[5] is not table[5]  # built on each read
    assert table.lengths().tolist() == [len(e.ids) for e in examples]
    assert table.target_counts().tolist() == [sum(e.mask[1:]) for e in examples]
    picked = table.take([7, 3, 30])
    assert list(picked) == [examples[7], examples[3], examples[30]]
    assert picked.target_counts().tolist() == [sum(examples[i].mask[1:]) for i in (7, 3, 30)]
    assert list(table[10:14]) == examples[10:14] and list(picked[1:]) == [examples[3], examples[30]]
    whole = Dataset(examples, stats, "d.jsonl")
    for a, b in zip(
        split_sets(back, 0.2, 3, seed=4), split_sets(whole, 0.2, 3, seed=4), strict=True
    ):
        assert list(a.examples) == list(b.examples)
        assert (a.stats.tokens, a.stats.target_tokens) == (b.stats.tokens, b.stats.target_tokens)


def test_a_broken_entry_is_rebuilt_not_an_error(tmp_path, data_dir, llama_dir, encodes):
    r = tiny_recipe(data_dir, llama_dir)
    first = trainer(r, tmp_path / "a")
    for entry in cache.cache_root().iterdir():
        (entry / "meta.json").write_text("{not json")
    encodes["n"] = 0
    again = trainer(r, tmp_path / "b")
    assert encodes["n"] > 0 and splits(again) == splits(first)


class Rank:
    def __init__(self, rank):
        self.rank, self.size, self.main = rank, 2, rank == 0
        self.barriers = 0

    def barrier(self):
        self.barriers += 1


def test_rank_zero_builds_the_entry_and_the_others_read_it(tmp_path):
    built = []

    def build(name):
        def make():
            built.append(name)
            return Dataset([Example([1, 2], [0, 1])], SplitStats(examples=1, kept=1), "d")

        return make

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    tok = _Tok()
    kinds = (Example,)
    other = Rank(1)
    # rank 1 on a disk rank 0 never wrote to builds its own, after waiting for rank 0
    cache.cached(str(data), tok, {"s": 1}, build("rank 1 alone"), kinds, world=other)
    assert built == ["rank 1 alone"] and other.barriers == 1
    main = Rank(0)
    got = cache.cached(str(data), tok, {"s": 2}, build("rank 0"), kinds, world=main)
    again = cache.cached(str(data), tok, {"s": 2}, build("rank 1"), kinds, world=Rank(1))
    assert built == ["rank 1 alone", "rank 0"] and main.barriers == 1
    assert list(again.examples) == list(got.examples) and again.stats.cached


class _Tok:
    """The least a tokenizer shows the cache: its vocabulary, template and special tokens."""

    eos_token_id = 2
    chat_template = None
    special_tokens_map = {"eos_token": "</s>"}

    def get_vocab(self):
        return {"a": 0, "b": 1, "</s>": 2}


def test_a_resumed_run_reads_its_splits_from_the_cache(tmp_path, data_dir, llama_dir, encodes):
    """--resume loads the tokenizer the run saved: the same tokenizer, the same entry."""
    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 2, "log_every": 1, "progress": False},
        checkpoints={"every": 1},
    )
    trainer(r, tmp_path / "run").run()
    r["train"]["max_steps"] = 3
    encodes["n"] = 0
    resumed = trainer(r, tmp_path / "run", resume="latest")
    assert encodes["n"] == 0 and resumed.train_set.stats.cached


def test_a_split_held_out_of_cached_data_says_so(tmp_path, data_dir, llama_dir, encodes):
    r = tiny_recipe(data_dir, llama_dir)
    r["data"].pop("valid")
    trainer(r, tmp_path / "a")
    again = trainer(r, tmp_path / "b")
    assert again.train_set.stats.cached and again.valid_set.stats.cached
    assert "read from the cache" in again.train_set.stats.line()


def test_encoding_shows_a_progress_bar_on_a_terminal_only(tmp_path, data_dir, llama_dir):
    import io

    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    r = tiny_recipe(data_dir, llama_dir)
    r["train"]["progress"] = True
    shown, hidden = Terminal(), io.StringIO()
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "a", console=Console(stream=shown))
    bars = [b for b in shown.getvalue().split("\r") if "encoding train.jsonl" in b]
    assert bars
    assert f"/{len((data_dir / 'train.jsonl').read_text().splitlines()):,} rows" in bars[-1]
    # a log file (no terminal) gets no bar
    r2 = tiny_recipe(data_dir, llama_dir, data={**r["data"], "cache": False})
    r2["train"]["progress"] = True
    Trainer(recipe_from_dict(r2), run_dir=tmp_path / "b", console=Console(stream=hidden))
    assert "encoding" not in hidden.getvalue()
