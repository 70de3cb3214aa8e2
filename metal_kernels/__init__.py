"""Kernel sources for mlxtune's fused operations, installed as ``mlxtune.metal_kernels``.

Each kernel is written once, as a function body (``*.body``) in the common subset of Metal,
CUDA and C++. A small prelude per backend supplies what differs:

- ``ktid``, ``kbx``, ``kby``, ``klane``, ``kwarp``: the thread's index in its group, the group's
  position in the grid, its lane and SIMD-group (warp) index;
- ``KSHARED`` (threadgroup / __shared__ storage) and ``KBARRIER()``;
- ``KEXP``, ``KLOG``, ``KTANH``, ``ksimd_sum``, ``ksimd_max``.

``prelude_metal.h`` + ``body_metal.h`` make a Metal kernel for ``mx.fast.metal_kernel``;
``prelude_cuda.h`` + ``body_cuda.h`` its CUDA twin for ``mx.fast.cuda_kernel``;
``prelude_emulate.h`` + ``body_emulate.h`` a C++ program that runs the same body on the CPU,
one coroutine per GPU thread (see ``emulate.py``), which is how the bodies are tested on
machines without a GPU. The signatures are the ones MLX generates: inputs, then outputs, in the
order given below, with ``<name>_shape`` for inputs whose shape the body reads, and the
constants (``consts``) as template parameters.

A launch is ``(kernel, inputs, outputs, groups, threads, consts)``: ``groups`` is the number of
threadgroups along x and y, ``threads`` the threads per group (one-dimensional groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Threadgroup memory per group that every kernel stays within: 32 KB, Apple GPUs' limit (CUDA
# allows 48 KB of static shared memory).
SHARED_FLOATS = 8192


@dataclass(frozen=True)
class Kernel:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    text: str | None = None
    """The body itself; None reads ``<name>.body`` from this folder."""

    @property
    def body(self) -> str:
        return self.text if self.text is not None else (HERE / f"{self.name}.body").read_text()

    def shape_inputs(self) -> list[str]:
        """Inputs whose ``<name>_shape`` the body reads (MLX passes only those)."""
        body = self.body
        return [n for n in self.inputs if f"{n}_shape" in body]


LCE_FORWARD = Kernel("lce_forward", ("z", "tl", "st", "prm"), ("nst",))
LCE_BACKWARD = Kernel("lce_backward", ("z", "tl", "lse", "g", "prm"), ("dz",))
ATTN_FORWARD = Kernel("attn_forward", ("q", "k", "v", "seg", "prm"), ("o", "lse"))
ATTN_DQ = Kernel("attn_dq", ("q", "k", "v", "dout", "lse", "dlt", "seg", "prm"), ("dq",))
ATTN_DKV = Kernel("attn_dkv", ("q", "k", "v", "dout", "lse", "dlt", "seg", "prm"), ("dk", "dv"))
KERNELS = (LCE_FORWARD, LCE_BACKWARD, ATTN_FORWARD, ATTN_DQ, ATTN_DKV)

BACKENDS = ("metal", "cuda", "emulate")


def header(backend: str) -> str:
    """The prelude that goes before the kernel function."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
    return (HERE / f"prelude_{backend}.h").read_text()


def source(kernel: Kernel, backend: str) -> str:
    """The kernel function's body for ``backend``: its ids and barriers, then the common body."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
    return (HERE / f"body_{backend}.h").read_text() + kernel.body


def attention_block(head_dim: int, kernel: Kernel) -> int | None:
    """Rows per tile (BQ) for an attention kernel at this head dimension: the largest power of two
    up to 32 whose tiles fit SHARED_FLOATS; None when the kernels do not take this head size."""
    if head_dim % 4 or head_dim <= 0:
        return None
    tiles = {"attn_forward": (3, 1), "attn_dq": (4, 1), "attn_dkv": (4, 2)}[kernel.name]
    for bq in (32, 16, 8, 4):
        if tiles[0] * bq * head_dim + tiles[1] * bq * bq <= SHARED_FLOATS:
            return bq
    return None


CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int"}


def cuda_name(kernel: Kernel, dtypes: dict, consts: dict) -> str:
    """The function name of one instance in ``cuda_standalone``."""
    tags = [f"{k}{int(v)}" for k, v in consts.items()]
    tags += sorted({d for d in dtypes.values() if d != "int32"})
    return "_".join([f"mlxtune_{kernel.name}", *tags])


def parameters(kernel: Kernel, ctypes: dict[str, str], qualifier: str = "") -> list[str]:
    """The kernel function's parameters as C declarations: each input as a const pointer to its
    C type (``ctypes[name]``), followed by ``const int* NAME_shape`` where the body indexes the
    input's shape, then each output as ``float*``. ``qualifier`` (``__restrict__``) goes after
    the data pointers' ``*``."""
    shaped = set(kernel.shape_inputs())
    q = f"{qualifier} " if qualifier else ""
    params = []
    for name in kernel.inputs:
        params.append(f"const {ctypes[name]}* {q}{name}")
        if name in shaped:
            params.append(f"const int* {name}_shape")
    return params + [f"float* {q}{name}" for name in kernel.outputs]


def constants(consts: dict) -> list[str]:
    """The kernel's compile-time constants as ``constexpr`` lines (bools stay bools)."""
    lines = []
    for name, value in consts.items():
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        else:
            lines.append(f"  constexpr int {name} = {int(value)};")
    return lines


def cuda_standalone(launches: list[tuple[Kernel, dict, dict]]) -> str:
    """A CUDA translation unit holding the CUDA twins of several kernels, each as an
    ``extern "C" __global__`` function named by ``cuda_name``, for nvcc and for harnesses that load
    kernels without MLX (CuPy). Each launch is (kernel, {input: dtype name}, consts); shapes come
    as ``const int* <name>_shape`` device arrays (MLX passes them by value; the body only
    indexes them)."""
    parts = ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", header("cuda")]
    for kernel, dtypes, consts in launches:
        ctypes = {name: CTYPES[dtypes.get(name, "float32")] for name in kernel.inputs}
        params = parameters(kernel, ctypes, "__restrict__")
        parts += [
            f'extern "C" __global__ void {cuda_name(kernel, dtypes, consts)}({", ".join(params)}) {{',
            *constants(consts),
            source(kernel, "cuda"),
            "}",
        ]
    return "\n".join(parts) + "\n"
