"""Validation and test sets carved out of one data set: by fraction or count, with a seed."""

import pytest
from test_resume import trainer

from conftest import tiny_recipe
from mlxtune.data import split_sets
from mlxtune.data.encode import Dataset, Example, SplitStats
from mlxtune.errors import UserInputError


def dataset(n):
    examples = [Example(ids=[1, 2 + i, 3], mask=[0, 1, 1]) for i in range(n)]
    return Dataset(examples, SplitStats(examples=n, kept=n), "data.jsonl")


def ids(ds):
    return [e.ids[1] - 2 for e in ds.examples]


def test_counts_and_fractions_carve_disjoint_sets_in_file_order():
    train, valid, test = split_sets(dataset(50), 5, 7, seed=1)
    assert (len(ids(train)), len(ids(valid)), len(ids(test))) == (38, 5, 7)
    assert sorted(ids(train) + ids(valid) + ids(test)) == list(range(50))
    for ds in (train, valid, test):
        assert ids(ds) == sorted(ids(ds))
    assert train.stats.examples == 38 and valid.stats.examples == 5
    train, valid, test = split_sets(dataset(40), 0.1, 0.25, seed=1)
    assert (len(ids(valid)), len(ids(test)), len(ids(train))) == (4, 10, 26)
    _, valid, test = split_sets(dataset(40), 0.1, None, seed=1)
    assert len(ids(valid)) == 4 and test is None


def test_the_seed_draws_the_split():
    a = [ids(x) for x in split_sets(dataset(60), 6, 6, seed=3)]
    b = [ids(x) for x in split_sets(dataset(60), 6, 6, seed=3)]
    c = [ids(x) for x in split_sets(dataset(60), 6, 6, seed=4)]
    assert a == b and a != c
    # the draw is no run of consecutive rows: the held-out rows spread over the file
    assert max(a[1]) - min(a[1]) > 6


def test_holding_out_everything_is_refused_naming_the_file():
    with pytest.raises(UserInputError, match=r"data.jsonl: 10 examples cannot give 10 for "
                       r"validation and test.*give data.valid and data.test"):  # fmt: skip
        split_sets(dataset(10), 4, 6, seed=0)
    with pytest.raises(UserInputError, match="1 example cannot give 1 for validation"):
        split_sets(dataset(1), 0.05, None, seed=0)


def test_a_recipe_holds_out_valid_and_test_sets_by_count_with_its_own_seed(
    tmp_path, data_dir, llama_dir
):
    r = tiny_recipe(data_dir, llama_dir)
    r["data"].pop("valid", None)
    r["data"].update(valid_size=6, test_size=0.1, split_seed=11)
    t = trainer(r, tmp_path / "a")
    n = len(t.train_set.examples) + len(t.valid_set.examples) + len(t.test_set.examples)
    assert len(t.valid_set.examples) == 6
    assert len(t.test_set.examples) == round(n * 0.1)
    seen = [tuple(e.ids) for s in (t.train_set, t.valid_set, t.test_set) for e in s.examples]
    assert len(set(seen)) == len(seen)  # disjoint (the file's rows are distinct)
    again = trainer(r, tmp_path / "b")
    assert [e.ids for e in again.test_set.examples] == [e.ids for e in t.test_set.examples]
    r["data"]["split_seed"] = 12
    other = trainer(r, tmp_path / "c")
    assert [e.ids for e in other.test_set.examples] != [e.ids for e in t.test_set.examples]
