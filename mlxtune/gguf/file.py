"""Reading a GGUF file's header: metadata as plain Python values and tensors as memory-mapped
numpy views, in one pass.

The ``gguf`` package's reader builds an object per array element, which takes seconds for a
tokenizer's 50k-150k tokens and merges or a sentencepiece character map; here numeric arrays are
read in one ``frombuffer`` and strings in a tight loop, so opening a GGUF file costs well under a
second whatever its vocabulary. Layout (version 2 and 3): magic ``GGUF``, version (u32), tensor
count and metadata count (u64), the metadata (key, value type, value), the tensor infos (name,
dims innermost first, type, offset), then the tensor data from the next multiple of
``general.alignment`` (32 by default). Little-endian files only, as llama.cpp writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserInputError

# GGUF metadata value types (gguf.GGUFValueType) -> numpy scalar types
_SCALARS = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
# tensor types whose data is a plain numpy array of that dtype
_PLAIN = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass
class GGUFTensor:
    name: str
    type: int
    """ggml type id (``gguf.GGMLQuantizationType(type)``)."""
    shape: tuple[int, ...]
    """Dims innermost first, as GGUF lists them."""
    data: np.ndarray = field(repr=False)
    """Row-major (numpy order): plain types as their dtype; block-quantized types as uint8,
    the last dim in bytes."""

    @property
    def type_name(self) -> str:
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type).name
        except ValueError:
            return f"type {self.type}"


@dataclass
class GGUFFile:
    path: Path
    version: int
    fields: dict
    """Metadata, key -> value: int, float, bool, str, or a list (numeric arrays as numpy
    arrays, string arrays as lists of str)."""
    tensors: dict[str, GGUFTensor] = field(repr=False)
    types: dict[str, tuple[int, int | None]] = field(default_factory=dict, repr=False)
    """Metadata key -> (value type, element type of an array), as ``gguf.GGUFValueType`` ids:
    what copying a value into another file needs."""


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError("the file ends inside its header")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        return bytes(self.take(self.u64())).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, n = self.u32(), self.u64()
            if sub == _STRING:
                return [self.string() for _ in range(n)]
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            dt = np.dtype(_SCALARS[sub]).newbyteorder("<")
            return np.frombuffer(self.take(n * dt.itemsize), dtype=dt).copy()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        dt = np.dtype(_SCALARS[vtype]).newbyteorder("<")
        return np.frombuffer(self.take(dt.itemsize), dtype=dt)[0].item()


def open_gguf(path: str | Path) -> GGUFFile:
    """Read a GGUF file's metadata and map its tensors (UserInputError naming the file when it
    is not a GGUF file or is damaged)."""
    import gguf

    p = Path(path)
    try:
        mm = np.memmap(p, dtype=np.uint8, mode="r")
        c = _Cursor(memoryview(mm))
        if bytes(c.take(4)) != b"GGUF":
            raise ValueError("it does not start with GGUF's magic")
        version = c.u32()
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = c.u64(), c.u64()
        fields = {}
        types = {}
        for _ in range(n_kv):
            key, vtype = c.string(), c.u32()
            sub = None
            if vtype == _ARRAY:  # peek at the element type
                sub = struct.unpack("<I", c.buf[c.pos : c.pos + 4])[0]
            types[key] = (vtype, sub)
            fields[key] = c.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.u64() for _ in range(c.u32()))
            infos.append((name, dims, c.u32(), c.u64()))
        align = int(fields.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        tensors = {}
        for name, dims, kind, offset in infos:
            np_shape = tuple(reversed(dims)) or (1,)
            n = int(np.prod(np_shape))
            if kind in _PLAIN:
                dt = np.dtype(_PLAIN[kind])
                nbytes, shape = n * dt.itemsize, np_shape
            else:
                try:
                    qt = gguf.GGMLQuantizationType(kind)
                    block, size = gguf.GGML_QUANT_SIZES[qt]
                except (ValueError, KeyError):
                    raise ValueError(f"tensor {name} has an unknown type {kind}") from None
                if np_shape[-1] % block:
                    raise ValueError(f"tensor {name}'s rows do not fill whole blocks")
                dt, nbytes = np.dtype(np.uint8), n // block * size
                shape = (*np_shape[:-1], np_shape[-1] // block * size)
            lo = start + offset
            if lo + nbytes > len(mm):
                raise ValueError(f"the file ends inside tensor {name}")
            if name in tensors:
                raise ValueError(f"tensor {name} appears twice")
            data = mm[lo : lo + nbytes].view(dt).reshape(shape)
            tensors[name] = GGUFTensor(name, kind, dims, data)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise UserInputError(f"not a readable GGUF file: {e}", str(p)) from None
    except OSError as e:
        raise UserInputError(f"cannot read it: {e.strerror or e}", str(p)) from None
    return GGUFFile(p, version, fields, tensors, types)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its magic bytes, not its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass
class GGUFModelFile:
    """A GGUF file's metadata and tensors (memory-mapped), with the architecture's keys."""

    file: GGUFFile

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def fields(self) -> dict:
        return self.file.fields

    @property
    def tensors(self) -> dict:
        return self.file.tensors

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")

    def get(self, key: str, default=None):
        """``<arch>.<key>`` from the metadata."""
        return self.fields.get(f"{self.arch}.{key}", default)


def read_gguf(path: str | Path) -> GGUFModelFile:
    """Open a GGUF model file: its metadata as plain Python values, its tensors by name."""
    return GGUFModelFile(open_gguf(path))
