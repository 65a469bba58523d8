"""Argument checks shared by the kernel wrappers: they fail loudly before a launch, never inside one."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Hopper's grid dependency control (Triton 3.4+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels launch as before
    gdc_launch_dependents = gdc_wait = None

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# A KV cache holds the model's dtype or fp8 (e4m3, unscaled as vLLM's default `--kv-cache-dtype
# fp8`: values are clamped to its range, ±448, and read back as the model's dtype).
FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def kv_dtypes(q_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (q_dtype, FP8_KV)


def to_kv_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV cache's dtype: fp8 saturates (torch would give NaN past its range on some paths)."""
    if dtype == FP8_KV:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes when its dtype is a 1-byte float (fp8), which torch's index ops do not take."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def copy_rows_(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(dim, index, src), also for fp8 (moved as bytes)."""
    byte_view(dst).index_copy_(dim, index, byte_view(src))


def check(cond: bool, message: str, *args) -> None:
    """A ValueError, not an assert (it must survive `python -O`); the message is a str.format
    template filled in only on failure, so a passing check costs next to nothing."""
    if not cond:
        raise ValueError(message.format(*args))


def check_tensor(
    t: torch.Tensor,
    name: str,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    last_contiguous: bool = True,
    contiguous: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {tuple(dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    elif last_contiguous and t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(f"{name} must be contiguous in its last dimension (strides {t.stride()})")


def check_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def check_paged_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor) -> tuple[int, int]:
    """The checks every paged-attention wrapper shares; returns (block size, kv heads)."""
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    head_dim, device = q.shape[2], q.device
    check_tensor(k_cache, "k_cache", ndim=4, dtypes=kv_dtypes(q.dtype), device=device)
    check_tensor(v_cache, "v_cache", ndim=4, dtypes=(k_cache.dtype,), device=device)
    n_blocks, page, n_kv, _ = k_cache.shape
    check_shape(k_cache, "k_cache", (n_blocks, page, n_kv, head_dim))
    check_shape(v_cache, "v_cache", tuple(k_cache.shape))
    check(q.shape[1] % n_kv == 0, "{} query heads are not a multiple of {} kv heads", q.shape[1], n_kv)
    check(page > 0 and page & (page - 1) == 0, "block size must be a power of two, got {}", page)
    check(head_dim >= 16, "head_dim must be at least 16, got {}", head_dim)
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=device)
    return page, n_kv


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs stay IEEE fp32 in tl.dot (no silent TF32); 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Fixed when the kernels are defined, as triton.jit itself decides interpreted vs compiled then.
INTERPRET = tl.constexpr(_interpreting())


# Programmatic dependent launch (Hopper): INFERNO_PDL=1 on, =0 off (A/B runs); unset, what the
# process chose with use_pdl. W1 on two H100s (2026-11-27, bench/w1_ab.sh): 8B TP=2 +2.7 %
# (3.622 -> 3.526 ms/step), one GPU -0.4 % (5.715 -> 5.741), so tensor-parallel ranks turn it on.
_PDL_ENV = os.environ.get("INFERNO_PDL")
_pdl_chosen = False


def use_pdl(on: bool) -> None:
    """Whether this process's decode kernels launch with programmatic dependent launch (set before
    the first launch: compiled variants and CUDA graphs keep what they were made with)."""
    global _pdl_chosen
    _pdl_chosen = on


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    return (not INTERPRET.value and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_args(device: torch.device) -> dict:
    """A decode step's kernel launch arguments: with programmatic dependent launch, the next
    kernel's blocks are scheduled while this one runs, and wait in pdl_enter for its end (its
    memory flushed), so the step's ~300 launches overlap their launch latency."""
    wanted = _pdl_chosen if _PDL_ENV is None else _PDL_ENV != "0"
    return {"PDL": True, "launch_pdl": True} if wanted and _pdl_capable(device) else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel launched with pdl_args: wait until the kernel before it in the stream
    has finished and its writes are visible (as a plain launch would have), then let the next one
    be scheduled. Both are no-ops in a kernel not launched so."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """fp32 -> dtype with round-to-nearest-even, also under TRITON_INTERPRET.

    The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even), so there the
    rounding is done on the bits first; compiled code takes the plain cast.
    """
    if INTERPRET:
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x == x, b.to(tl.float32, bitcast=True), x)
    return x.to(dtype)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation (the interpreter's 16-bit dot is broken: upcast there)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def to_kv(x, dtype: tl.constexpr):
    """fp32 -> a KV cache's dtype: fp8 saturates at ±448 (its cast does not), the rest rounds to nearest even."""
    if dtype == tl.float8e4nv:
        x = tl.clamp(x, -448.0, 448.0)
        if INTERPRET:
            # The interpreter's fp8 cast does not round to nearest even (and loses a carry into
            # the exponent: 1.98 -> 1.0), so round first: 3 mantissa bits kept on the bits, and
            # subnormals (below 2^-6) to a multiple of 2^-9 by adding 1.5 * 2^23.
            b = x.to(tl.uint32, bitcast=True)
            normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
            sub = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
            x = tl.where(tl.abs(x) < 0.015625, sub, normal)
        return x.to(dtype)
    return cast_rtne(x, dtype)
