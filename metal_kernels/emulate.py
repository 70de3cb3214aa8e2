"""Run a kernel body on the CPU, as a GPU would run it: for tests on machines without a GPU.

The body is compiled with the C++ prelude (prelude_emulate.h): every GPU thread of a group is a
coroutine with its own stack, shared memory is shared by the group's coroutines, and a barrier
switches back to a scheduler that resumes the threads in a fresh random order. What this checks
is the body itself: its indexing, bounds, masking, reductions and barrier discipline (a read of
shared memory before the barrier that publishes it returns stale data in some orders; a thread
that leaves while others wait at a barrier is an error). What it cannot check is the
per-backend prelude and timing; the CUDA prelude is compiled by ``nvcc`` in the tests where
nvcc exists, and runs under ``pytest -m cuda`` on an NVIDIA machine.

Outputs start as NaN, so an element the kernel fails to write shows up.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import Kernel, constants, header, parameters, source

_LIBS: dict[str, ctypes.CDLL] = {}


class EmulationError(RuntimeError):
    """The kernel did something a GPU would not survive (a divergent barrier)."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _ctype(a: np.ndarray) -> str:
    if a.dtype == np.float32:
        return "float"
    if a.dtype == np.int32:
        return "int"
    raise TypeError(f"the emulator takes float32 and int32 arrays, not {a.dtype}")


def program(kernel: Kernel, inputs: list[np.ndarray], consts: dict) -> str:
    """The C++ translation unit that runs ``kernel`` with these input types and constants."""
    c_types = {name: _ctype(a) for name, a in zip(kernel.inputs, inputs, strict=True)}
    params = parameters(kernel, c_types)
    # the launcher passes every pointer through P, in the parameters' order
    args = [f"({p.rsplit(' ', 1)[0]})P[{i}]" for i, p in enumerate(params)]
    lines = constants(consts)
    return "\n".join(
        [
            header("emulate"),
            f"static void kbody({', '.join(params)}) {{",
            *lines,
            source(kernel, "emulate"),
            "}",
            "static void* P[64];",
            "static void entry() {",
            f"  kbody({', '.join(args)});",
            "  kemu::threads[kemu::cur].state = 2;",
            "}",
            'extern "C" int kemu_launch(void** p, int n, int gx, int gy, int tg, unsigned seed,',
            "                           long* barriers) {",
            "  for (int i = 0; i < n; ++i) P[i] = p[i];",
            "  kemu::n_barriers = 0;",
            "  int rc = kemu::run_grid(entry, gx, gy, tg, seed);",
            "  *barriers = kemu::n_barriers;",
            "  return rc;",
            "}",
        ]
    )


def _cache_dir() -> Path:
    base = os.environ.get("MLXTUNE_KERNEL_CACHE") or os.path.join(
        tempfile.gettempdir(), f"mlxtune-kemu-{os.getuid()}"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _library(code: str) -> ctypes.CDLL:
    key = hashlib.sha256(code.encode()).hexdigest()[:20]
    if key in _LIBS:
        return _LIBS[key]
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the kernel emulator needs a C++ compiler (g++)")
    so = _cache_dir() / f"{key}.so"
    if not so.exists():
        src = so.with_suffix(".cpp")
        src.write_text(code)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-o", str(tmp), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kernel did not compile:\n{done.stderr[-4000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.kemu_launch.restype = ctypes.c_int
    _LIBS[key] = lib
    return lib


def run(
    kernel: Kernel,
    inputs: list[np.ndarray],
    outputs: list[tuple[int, ...]],
    groups: tuple[int, int],
    threads: int,
    consts: dict,
    seed: int = 0,
) -> tuple[list[np.ndarray], int]:
    """Run ``kernel`` over ``groups`` threadgroups of ``threads`` threads: (outputs, barriers).

    Inputs are float32 or int32 arrays (made contiguous here); outputs are float32, NaN until
    written."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    lib = _library(program(kernel, inputs, consts))
    shaped = set(kernel.shape_inputs())
    keep, ptrs = [], []
    for name, a in zip(kernel.inputs, inputs, strict=True):
        keep.append(a)
        ptrs.append(a.ctypes.data)
        if name in shaped:
            shape = np.zeros(8, dtype=np.int32)
            shape[: a.ndim] = a.shape
            keep.append(shape)
            ptrs.append(shape.ctypes.data)
    outs = [np.full(shape, np.nan, dtype=np.float32) for shape in outputs]
    ptrs += [o.ctypes.data for o in outs]
    array = (ctypes.c_void_p * len(ptrs))(*ptrs)
    barriers = ctypes.c_long(0)
    rc = lib.kemu_launch(
        array,
        len(ptrs),
        int(groups[0]),
        int(groups[1]),
        int(threads),
        ctypes.c_uint(seed),
        ctypes.byref(barriers),
    )
    if rc == 1:
        raise EmulationError(
            f"{kernel.name}: some threads finished while others waited at a barrier "
            "(a barrier inside divergent control flow)"
        )
    return outs, barriers.value
