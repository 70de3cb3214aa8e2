"""Data as it is published: Parquet and Arrow files (written here by pyarrow), globs of shards,
and folders ``datasets``' ``save_to_disk`` wrote. Each reads to the rows the same data gives as
JSONL, with its rows named by file and index."""

import json
from pathlib import Path

import pytest

from conftest import offline_hub
from mlxtune.data import BadRows, Encoder, load_split, read_rows
from mlxtune.errors import UserInputError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [
    {"prompt": "what is two and two?", "completion": " four"},
    {"prompt": "name a colour", "completion": " blue", "system": "be brief"},
    {"prompt": "hello there", "completion": " hi, how can i help"},
    {
        "messages": None,  # a column another row fills: null here
        "prompt": "the quick brown fox",
        "completion": " jumps over the lazy dog",
    },
]


def as_jsonl(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows)
    )
    return path


def table(rows):
    keys = sorted({k for r in rows for k in r})
    return pa.table({k: [r.get(k) for r in rows] for k in keys})


def test_a_parquet_file_reads_to_the_rows_jsonl_gives(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(table(ROWS), path)
    want = read_rows(as_jsonl(tmp_path, ROWS))
    got = read_rows(path)
    assert got == want  # (number, row): a null field is left out, as JSON would leave it
    assert "system" not in got[0][1] and got[1][1]["system"] == "be brief"


@pytest.mark.parametrize("kind", ["file", "stream", "feather"])
def test_arrow_files_read_to_the_same_rows(kind, tmp_path):
    path = tmp_path / ("train.feather" if kind == "feather" else "train.arrow")
    t = table(ROWS)
    if kind == "feather":
        import pyarrow.feather as feather

        feather.write_feather(t, path)
    else:
        writer = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
        with pa.OSFile(str(path), "wb") as sink, writer(sink, t.schema) as w:
            w.write_table(t)
    assert read_rows(path) == read_rows(as_jsonl(tmp_path, ROWS))


def test_a_glob_of_shards_reads_them_in_order_each_row_named_by_its_shard(tmp_path):
    pq.write_table(table(ROWS[2:]), tmp_path / "train-00001.parquet")
    pq.write_table(table(ROWS[:2]), tmp_path / "train-00000.parquet")
    rows = read_rows(tmp_path / "train-*.parquet")
    assert [r for _, r in rows] == [r for _, r in read_rows(as_jsonl(tmp_path, ROWS))]
    assert [n for n, _ in rows] == [
        "train-00000.parquet:1", "train-00000.parquet:2",
        "train-00001.parquet:1", "train-00001.parquet:2",
    ]  # fmt: skip
    with pytest.raises(UserInputError, match="no file matches"):
        read_rows(tmp_path / "valid-*.parquet")


def test_a_bad_row_of_a_parquet_file_is_named_by_its_file_and_row(tmp_path, tokenizer):
    rows = [dict(r) for r in ROWS]
    rows[2]["completion"] = None  # the third row has no completion
    path = tmp_path / "train.parquet"
    pq.write_table(table(rows), path)
    with pytest.raises(UserInputError) as e:
        load_split(path, Encoder(tokenizer), "completion", 64, "truncate", 1)
    assert e.value.where == f"{path}:3"
    bad = BadRows(skip=True, max_fraction=0.5)
    ds = load_split(path, Encoder(tokenizer), "completion", 64, "truncate", 1, bad=bad)
    assert len(ds.examples) == 3 and bad.seen[0][0] == f"{path}:3"


def test_a_saved_dataset_and_a_split_of_a_saved_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    want = [r for _, r in read_rows(as_jsonl(tmp_path, ROWS))]
    clean = [{k: v for k, v in r.items() if v is not None} for r in ROWS]
    keys = sorted({k for r in clean for k in r})
    full = {k: [r.get(k) for r in clean] for k in keys}
    ds = datasets.Dataset.from_dict(full)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert [r for _, r in read_rows(tmp_path / "saved")] == want

    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict(full).select([0])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert [r for _, r in read_rows(tmp_path / "dict#train")] == want
    assert [r for _, r in read_rows(tmp_path / "dict#test")] == want[:1]
    with pytest.raises(UserInputError, match="holds the splits train, test; name one after a '#'"):
        read_rows(tmp_path / "dict")
    with pytest.raises(UserInputError, match="holds the splits"):
        read_rows(tmp_path / "dict#validation")
    with pytest.raises(UserInputError, match="names a split, and this folder holds one dataset"):
        read_rows(tmp_path / "saved#train")


def test_a_folder_that_is_not_a_saved_dataset_is_refused(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserInputError, match="save_to_disk wrote"):
        read_rows(tmp_path / "folder")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserInputError, match="not a readable .parquet file"):
        read_rows(tmp_path / "broken.parquet")


def test_a_run_from_parquet_shards_and_a_saved_dataset_trains_as_from_jsonl(
    tmp_path, data_dir, llama_dir
):
    """The same rows as Parquet shards (train) and a saved DatasetDict's split (valid): the run's
    losses equal the JSONL run's, step for step."""
    from test_resume import rows as metrics
    from test_resume import trainer

    from conftest import tiny_recipe

    datasets = pytest.importorskip("datasets")
    train = [r for _, r in read_rows(data_dir / "train.jsonl")]
    valid = [r for _, r in read_rows(data_dir / "valid.jsonl")]
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(table(train[:50]), shards / "train-00000-of-00002.parquet")
    pq.write_table(table(train[50:]), shards / "train-00001-of-00002.parquet")
    keys = sorted({k for r in valid for k in r})
    saved = datasets.DatasetDict(
        {"validation": datasets.Dataset.from_dict({k: [r.get(k) for r in valid] for k in keys})}
    )
    saved.save_to_disk(str(tmp_path / "saved"))

    train_cfg = {"batch_size": 8, "max_steps": 4, "log_every": 1, "progress": False, "seed": 3}
    want = tiny_recipe(data_dir, llama_dir, train=train_cfg, eval={"every": 2})
    trainer(want, tmp_path / "jsonl").run()
    got = tiny_recipe(data_dir, llama_dir, train=train_cfg, eval={"every": 2})
    got["data"]["train"] = str(shards / "train-*.parquet")
    got["data"]["valid"] = str(tmp_path / "saved#validation")
    trainer(got, tmp_path / "parquet").run()
    a, b = metrics(tmp_path / "jsonl"), metrics(tmp_path / "parquet")
    for key in ("loss", "eval_loss"):
        assert [r[key] for r in a if key in r] == [r[key] for r in b if key in r]
    assert any("eval_loss" in r for r in b)


def test_a_hub_dataset_id_reads_from_the_local_cache_offline(tmp_path, monkeypatch):
    """hf:ORG/NAME[@REVISION][#SPLIT]: the repository as the Hugging Face cache holds it (no
    network here: offline), each split read by datasets."""
    pytest.importorskip("datasets")
    sha = offline_hub(
        tmp_path,
        monkeypatch,
        "acme/chats",
        {
            "data/train-00000-of-00001.parquet": table(ROWS).slice(0, 3),
            "data/test-00000-of-00001.parquet": table(ROWS).slice(3),
        },
    )
    want = [r for _, r in read_rows(as_jsonl(tmp_path, ROWS))]

    rows = read_rows(Path("hf:acme/chats"))
    assert [r for _, r in rows] == want[:3] and [n for n, _ in rows] == ["1", "2", "3"]
    assert [r for _, r in read_rows(Path("hf:acme/chats#test"))] == want[3:]
    assert [r for _, r in read_rows(Path(f"hf:acme/chats@{sha}#train[:2]"))] == want[:2]
    # data_files: the repository's files to read (they make the train split)
    picked = read_rows(Path("hf:acme/chats?data_files=data/test-*.parquet"))
    assert [r for _, r in picked] == want[3:]
    both = read_rows(Path("hf:acme/chats?data_files=data/test-*,data/train-*#train[:2]"))
    assert [r for _, r in both] == [want[3], want[0]]
    with pytest.raises(UserInputError, match="no file of the dataset matches data_files x/"):
        read_rows(Path("hf:acme/chats?data_files=x/*.parquet"))
    with pytest.raises(UserInputError, match="the one option of a hub dataset is"):
        read_rows(Path("hf:acme/chats?files=data/*"))
    with pytest.raises(UserInputError, match="neither in the local Hugging Face cache"):
        read_rows(Path("hf:acme/missing"))
    with pytest.raises(UserInputError, match="cannot read the dataset"):
        read_rows(Path("hf:acme/chats#validation"))
