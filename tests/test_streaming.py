"""data.streaming: the training set read, encoded and batched a window at a time. The rows a
stream reads from any place equal the whole-file reader's; one epoch of windows trains on every
example of the file once; a stream resumed from any batch gives the batches an uninterrupted one
gives; a streamed run crashed and resumed writes the metrics rows of an uninterrupted run."""

import csv
import json
from collections import Counter

import pytest

from conftest import (
    make_crash,
    offline_hub,
    reverse_rows,
    run_rows,
    tiny_recipe,
    write_jsonl,
)
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.data import (
    Cursor,
    Encoder,
    StreamedSet,
    load_split,
    read_rows,
    read_stream,
    stream_files,
)
from mlxtune.errors import UserInputError


def _rows_of(source):
    """(name, row) of every row, read from the start and from every place in between."""
    files = stream_files(str(source))
    read = list(read_stream(str(source), files, Cursor()))
    names = [(n, obj) for n, obj, _ in read]
    for k in range(len(read)):  # from after row k: the rows after it, and nothing else
        again = [(n, obj) for n, obj, _ in read_stream(str(source), files, read[k][2])]
        assert again == names[k + 1 :], k
    return names


def _whole(source):
    return [(str(n), obj) for n, obj in read_rows(source)]


def test_a_jsonl_stream_reads_the_files_rows_from_any_place(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"row {i} é"}) for i in range(7)]
    lines.insert(3, "")  # a blank line is no row
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    assert _rows_of(p) == _whole(p)
    assert [n for n, _ in _rows_of(p)] == ["1", "2", "3", "5", "6", "7", "8"]


def test_text_csv_and_tsv_streams_read_as_the_whole_file_readers(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("first para\nline two\n\n\nsecond\n\nthird one\nends")
    assert _rows_of(txt) == _whole(txt)
    for suffix, delim in ((".csv", ","), (".tsv", "\t")):
        p = tmp_path / f"d{suffix}"
        with open(p, "w", newline="") as f:
            w = csv.writer(f, delimiter=delim)
            w.writerow(["prompt", "completion"])
            w.writerow(["a, b", 'say "x"\nover two lines'])
            w.writerow(["", ""])  # an empty row is no example
            w.writerow(["c", "d"])
            w.writerow(["e", "f"])
        assert _rows_of(p) == _whole(p)


def test_parquet_arrow_globs_and_saved_datasets_stream_from_any_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    table = pa.table({"prompt": [f"p{i}" for i in range(9)], "completion": ["c"] * 9})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=4)  # three row groups
    assert _rows_of(tmp_path / "d.parquet") == _whole(tmp_path / "d.parquet")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as w:
            for b in table.to_batches(max_chunksize=2):
                w.write_batch(b)
    assert _rows_of(tmp_path / "d.arrow") == _whole(tmp_path / "d.arrow")
    for i in range(3):
        write_jsonl(
            tmp_path / "parts" / f"part-{i}.jsonl", [{"text": f"{i}-{j}"} for j in range(3)]
        )
    glob = tmp_path / "parts" / "part-*.jsonl"
    assert _rows_of(glob) == _whole(glob)
    assert _rows_of(glob)[3][0] == "part-1.jsonl:1"
    datasets.Dataset.from_dict({"text": [f"s{i}" for i in range(5)]}).save_to_disk(
        str(tmp_path / "saved")
    )
    assert _rows_of(tmp_path / "saved") == _whole(tmp_path / "saved")


def test_a_json_array_and_binary_files_are_refused_for_streaming(tmp_path):
    p = tmp_path / "d.json"
    p.write_text('[{"text": "a"}]')
    with pytest.raises(UserInputError, match="JSON array is read whole"):
        stream_files(str(p))
    (tmp_path / "d.xlsx").write_bytes(b"PK")
    with pytest.raises(UserInputError, match="xlsx"):
        stream_files(str(tmp_path / "d.xlsx"))


def _stream(source, tokenizer, window, **kw):
    enc = Encoder(tokenizer)
    return StreamedSet(
        str(source), enc, "auto", (48, "truncate", 2), None, (False, 0.05), 1, window
    )


def _take(stream, n, **kw):
    args = dict(batch_size=4, pad_id=0, multiple=8, seed=1, bucket_size=2)
    args.update(kw)
    it = stream.batches(**args)
    out = []
    for _ in range(n):
        epoch, b = next(it)
        out.append((epoch, b.tokens.tolist(), b.mask.tolist(), stream.state.to_json()))
    return out


@pytest.mark.parametrize("packing", ["off", "pack", "stream"])
def test_one_epoch_of_windows_trains_on_each_example_once(tmp_path, tokenizer, packing):
    p = tmp_path / "train.jsonl"
    write_jsonl(p, reverse_rows(50, seed=4))
    whole = load_split(p, Encoder(tokenizer), "auto", 48, "truncate", 2)
    stream = _stream(p, tokenizer, window=16)  # windows of 16, 16, 16 and 2 rows
    kw = {} if packing == "off" else {"packing": packing, "capacity": 64}
    batches = _take(stream, 40, **kw)
    first = [b for b in batches if b[0] == 0]
    assert any(b[0] == 1 for b in batches)  # the second epoch began
    tokens = Counter()
    for _, rows, _, _ in first:
        for row in rows:
            tokens.update(t for t in row if t != 0)
    want = Counter(t for e in whole.examples for t in e.ids if t != 0)
    assert tokens == want
    if packing == "off":  # whole examples, one a row: each exactly once
        got = sorted(tuple(t for t in row if t) for _, rows, _, _ in first for row in rows)
        assert got == sorted(tuple(t for t in e.ids if t) for e in whole.examples)


@pytest.mark.parametrize("packing", ["off", "pack"])
def test_a_stream_resumed_from_any_batch_gives_the_same_batches(tmp_path, tokenizer, packing):
    p = tmp_path / "train.jsonl"
    write_jsonl(p, reverse_rows(30, seed=5))
    kw = {} if packing == "off" else {"packing": packing, "capacity": 64}
    want = _take(_stream(p, tokenizer, window=8), 24, **kw)  # across windows and epochs
    assert {b[0] for b in want} >= {0, 1}
    for k in range(1, len(want)):
        again = _stream(p, tokenizer, window=8)
        again.resume(want[k - 1][3])
        assert _take(again, len(want) - k, **kw) == want[k:], k


def test_held_out_rows_are_the_first_ones_and_never_train(tmp_path, tokenizer):
    p = tmp_path / "train.jsonl"
    rows = reverse_rows(20, seed=6)
    write_jsonl(p, rows)
    stream = _stream(p, tokenizer, window=100)
    valid, test = stream.hold_out([3, 2])
    assert [obj for _, obj in valid] == rows[:3]
    assert [obj for _, obj in test] == rows[3:5]
    first = [b for b in _take(stream, 10) if b[0] == 0]
    trained = sorted(tuple(t for t in row if t) for _, rs, _, _ in first for row in rs)
    enc = Encoder(tokenizer)
    want = sorted(tuple(enc.encode(r, "completion", "x").ids) for r in rows[5:])
    assert trained == want
    with pytest.raises(UserInputError, match="keep one to train on"):
        _stream(p, tokenizer, window=100).hold_out([20, 0])


def test_bad_rows_in_a_stream_are_skipped_or_named(tmp_path, tokenizer):
    p = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in reverse_rows(40, seed=7)]
    lines[25] = "{not json"
    p.write_text("\n".join(lines) + "\n")
    stream = _stream(p, tokenizer, window=10)
    with pytest.raises(UserInputError) as e:
        _take(stream, 30)
    assert e.value.where == f"{p}:26"
    enc = Encoder(tokenizer)
    skipping = StreamedSet(str(p), enc, "auto", (48, "truncate", 2), None, (True, 0.2), 1, 10)
    first = [b for b in _take(skipping, 30) if b[0] == 0]
    assert sum(len(rs) for _, rs, _, _ in first) == 39


def _recipe(data_dir, model_dir, **data):
    r = tiny_recipe(
        data_dir,
        model_dir,
        train={"batch_size": 4, "max_steps": 12, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 4},
        checkpoints={"every": 3, "keep_last": 5},
    )
    r["data"].update({"streaming": True, "stream_window": 20, **data})
    return r


def test_a_streamed_run_killed_and_resumed_equals_the_uninterrupted_run(
    tmp_path, llama_dir, tokenizer
):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", reverse_rows(44, seed=8))  # windows of 20, 20, 4: two epochs
    r = _recipe(d, llama_dir, valid=None, valid_size=6)
    quiet = Console(quiet=True)
    summary = Trainer(recipe_from_dict(r), run_dir=tmp_path / "whole", console=quiet).run()
    assert summary["steps"] == 12
    want = run_rows(tmp_path / "whole")
    assert max(row["epoch"] for row in want if "epoch" in row) >= 1  # it went round again
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(
            recipe_from_dict(r), run_dir=tmp_path / "cut", console=quiet, callbacks=[make_crash(7)]
        ).run()
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "cut", console=quiet, resume="latest").run()
    assert run_rows(tmp_path / "cut") == want
    state = json.loads(
        (tmp_path / "cut" / "checkpoints" / "step-000006" / "trainer_state.json").read_text()
    )
    assert state["resume"]["data_stream"]["cursor"][0] == 0
    derived = json.loads((tmp_path / "whole" / "config_resolved.json").read_text())["derived"]
    assert "streamed 20 rows a window" in derived["train_data"]
    assert derived["epochs"] is None and derived["train_examples"] is None


@pytest.mark.parametrize(
    "data,train,message",
    [
        ({}, {"max_steps": None, "epochs": 1}, "give train.max_steps"),
        ({"valid": None}, {}, "give data.valid, or data.valid_size"),
        ({"valid": None, "valid_size": 0.1}, {}, "a fraction (0.1) of it cannot be held out"),
        ({"stream_window": 0}, {}, "data.stream_window"),
    ],
)
def test_what_a_stream_cannot_do_exits_2_naming_the_key(
    tmp_path, data_dir, llama_dir, capsys, data, train, message
):
    r = _recipe(data_dir, llama_dir, **data)
    r["train"].update(train)
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(r))
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_streaming_is_for_sft(tmp_path, data_dir, llama_dir, capsys):
    r = _recipe(data_dir, llama_dir)
    r["objective"] = {"type": "dpo"}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(r))
    assert main(["validate", str(path)]) == 2
    assert "streams SFT data" in capsys.readouterr().err


def test_stream_window_without_streaming_is_reported(tmp_path, data_dir, llama_dir, capsys):
    r = tiny_recipe(data_dir, llama_dir)
    r["data"]["stream_window"] = 100
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(r))
    assert main(["validate", str(path)]) == 0
    assert "data.stream_window has no effect: data.streaming is false" in capsys.readouterr().out


def test_bad_rows_skipped_count_against_the_share_window_by_window(tmp_path, tokenizer):
    p = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in reverse_rows(20, seed=9)]
    lines[12] = lines[13] = lines[14] = "[1]"
    p.write_text("\n".join(lines) + "\n")
    enc = Encoder(tokenizer)
    stream = StreamedSet(str(p), enc, "auto", (48, "truncate", 2), None, (True, 0.2), 1, 10)
    with pytest.raises(UserInputError, match="3 of 10 rows are bad"):
        _take(stream, 10)


def test_a_hub_dataset_streams_from_the_local_cache_from_any_row(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    tables = {}
    for i in range(2):
        texts = [f"shard {i} document {j}" if j != 2 else None for j in range(4)]
        tables[f"data/train-0000{i}-of-00002.parquet"] = pa.table(
            {"text": texts, "id": list(range(4))}
        )
    offline_hub(tmp_path, monkeypatch, "acme/corpus", tables)
    source = "hf:acme/corpus"
    assert stream_files(source) is None  # read through datasets, row by row
    got = _rows_of(source)
    assert got == [(n, obj) for n, obj in read_rows(source)]
    assert len(got) == 8 and got[2][1] == {"id": 2}  # a null field is left out
