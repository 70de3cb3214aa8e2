"""Data: JSONL -> formatted examples -> token ids with a loss mask -> batches.

- ``formats``: the registry of data formats (how a row is recognised and what it trains on);
- ``rows``: reading a data file (JSONL, CSV/TSV, text) into rows, and skipping bad ones;
- ``encode``: tokenizing and masking (``Encoder``), splits and their stats;
- ``batching``: padded, length-bucketed batches in a seeded, resumable order;
- ``packing``: several examples to a row, with segment ids;
- ``stream``: a training set read, encoded and batched a window at a time (data.streaming).
"""

from .batching import (
    Batch,
    batch_order,
    eval_batches,
    iterate_batches,
    make_batch,
    read_positions,
    split_batch,
)
from .encode import (
    Dataset,
    Encoder,
    Example,
    ExampleTable,
    SplitStats,
    encode_rows,
    held_out,
    lengths_of,
    load_split,
    split_off,
    split_sets,
)
from .formats import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_INPUT,
    Chat,
    DataFormat,
    PromptAnswer,
    Text,
    Tokens,
    detect_format,
    field,
    format_names,
    get_format,
    register_format,
    unregister_format,
)
from .packing import iterate_packed, make_packed_batch, pack_rows, packed_epoch, stream_rows
from .rows import BadRows, read_rows
from .stream import Cursor, StreamedSet, StreamState, read_stream, stream_files

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_INPUT",
    "Batch",
    "Chat",
    "Cursor",
    "DataFormat",
    "Dataset",
    "Encoder",
    "Example",
    "ExampleTable",
    "PromptAnswer",
    "SplitStats",
    "StreamState",
    "StreamedSet",
    "Text",
    "Tokens",
    "batch_order",
    "detect_format",
    "encode_rows",
    "eval_batches",
    "field",
    "format_names",
    "get_format",
    "iterate_batches",
    "iterate_packed",
    "lengths_of",
    "load_split",
    "make_batch",
    "make_packed_batch",
    "pack_rows",
    "packed_epoch",
    "read_rows",
    "BadRows",
    "read_positions",
    "read_stream",
    "register_format",
    "split_batch",
    "held_out",
    "split_off",
    "split_sets",
    "stream_files",
    "stream_rows",
    "unregister_format",
]
