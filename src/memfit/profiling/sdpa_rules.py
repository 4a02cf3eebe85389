"""Which kernel ``F.scaled_dot_product_attention`` runs on a CUDA device: torch's rules, in Python.

NOTE [SDPA backend choice]
    On a CUDA tensor, ``scaled_dot_product_attention`` asks ``select_sdp_backend``
    (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) for a backend and calls its op;
    on the meta device fake mode traces on, it always takes the math fallback. This module
    restates those rules for a target that is not here (a fake-mode profile for an A100/H100/
    H200), so the trace records the op CUDA would dispatch. Read from torch's sources of the
    2.13 era (``sdp_utils.cpp``, ``sdp_utils_cpp.h``, ``attention.cpp``); the defaults read
    off the installed torch (priority order, enabled flags) agree with them. The rules:

    0. Order: torch's priority list (``memfit._torch.sdp_priority_order``: flash, efficient,
       math, cudnn by default, or what ``sdpa_kernel(..., set_priority=True)`` set), except
       that with the default list an sm90/sm10x device whose cuDNN is newer than 9.15.0 (and,
       on a CUDA < 13 build, of minor version 0 or 3) tries cudnn first, unless
       ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set. The first backend whose checks all pass
       wins; a disabled one (``torch.backends.cuda.enable_*_sdp``) never passes; with all four
       disabled, or none passing, CUDA raises "No available kernel".
    1. Every fused backend: q, k, v 4-D, dense (not nested), same batch size, non-zero
       sequence lengths, last dimension of stride 1 (and the mask's); the same number of
       heads, except with ``enable_gqa`` in flash (the heads of k, equal to v's, divide q's)
       and cuDNN (k's and v's heads each divide q's). Memory-efficient attention takes no
       GQA in torch 2.13 (its meta backward gives k's gradient q's heads; later sources
       allow it).
    2. Flash: no ``attn_mask``; q, k, v of one head dim, at most 256 (not a multiple of 8:
       padded to one, the output sliced back); sm80 to sm121; fp16 or bf16; ``is_causal``
       only with as many queries as keys; on sm86-89/sm120-121 when training, head dim at
       most 192 (or above 224 without dropout).
    3. Memory-efficient: sm50 to sm121; fp16, bf16 or fp32 (sm80+); q and k of one head
       dim; the head dims of q and v multiples of the GEMM alignment (8 for fp16/bf16, 4 for
       fp32 on sm80+), and the storage offsets of q, k, v aligned to it; an ``attn_mask``
       of any shape (converted to an additive bias, expanded to (b, heads, s_q, s_k), padded
       to a multiple of 16 keys).
    4. cuDNN: not under deterministic algorithms (unless warn-only); fp16 or bf16; sm80 to
       sm121; dropout a multiple of 1/16 (and none on cuDNN 9.11-9.13); batch and heads at
       most 65535; head dims multiples of 8, at most 128 (256 on sm90/sm10x with cuDNN newer
       than 9.22, 192/128 for q/v on those with cuDNN 9.11+), key length not 1; a mask not
       requiring grad, 2-D or 4-D broadcastable to (b, heads, s_q, s_k). (torch defines a
       layout check, q, k, v as (b, s, heads, d) transposed, but no longer applies it.)
    5. Math: whenever enabled. It upcasts fp16/bf16 to fp32 (unless
       ``allow_fp16_bf16_reduction_math_sdp``) and saves the (b, heads, s_q, s_k) softmax.

    Consequence: on a V100 (sm70) attention runs memory-efficient in fp16 or fp32 (flash and
    cuDNN need sm80; bf16 takes the math fallback), with fp32 head dims of any alignment (no
    tensor cores) and fp16 ones multiples of 8. On an A100 or H100, bf16/fp16 attention without a mask runs flash (it saves
    q, k, v, the output and a (b, heads, s_q) fp32 logsumexp, no s_q x s_k matrix); with a
    mask, or in fp32, memory-efficient (logsumexp padded to 32 queries); head dims flash and
    efficient both refuse (260 in bf16: above 256 and not a multiple of 8) fall back to math.
    The cuDNN version of the target is not known here: the presets assume cuDNN 9.10.2 (what
    torch's CUDA 12.8 wheels ship), so H100/H200 try flash first; a build with cuDNN 9.15.1
    or newer prefers cuDNN attention there (the same bytes saved, another op): set that
    order with ``torch.nn.attention.sdpa_kernel([...], set_priority=True)`` around the
    profile. Nested tensors, FA3 (fp8) and ROCm are not modelled.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass

import torch

__all__ = ["SdpBackend", "CudaArch", "CUDA_ARCHS", "SdpSettings", "SdpaCall", "problems",
           "select_backend"]


class SdpBackend(enum.Enum):
    """torch's SDPA backends (values as ``torch.nn.attention.SDPBackend``)."""

    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3


@dataclass(frozen=True)
class CudaArch:
    """The CUDA facts of a target the rules read: compute capability, cuDNN and CUDA versions
    (cuDNN as torch encodes it: 9.10.2 is 91002)."""

    name: str
    major: int
    minor: int
    cudnn_version: int = 91002
    cuda_major: int = 12


CUDA_ARCHS: dict[str, CudaArch] = {
    "v100": CudaArch("v100", 7, 0),   # sm70: no flash, no cuDNN attention, no bf16
    "a100": CudaArch("a100", 8, 0),   # sm80
    "h100": CudaArch("h100", 9, 0),   # sm90
    "h200": CudaArch("h200", 9, 0),   # sm90
}

_DEFAULT_ORDER = (SdpBackend.FLASH, SdpBackend.EFFICIENT, SdpBackend.MATH, SdpBackend.CUDNN)
_HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class SdpSettings:
    """The process's SDPA switches: which backends are enabled, their priority, and the
    global flags the rules read."""

    enabled: frozenset[SdpBackend]
    order: tuple[SdpBackend, ...] = _DEFAULT_ORDER
    deterministic: bool = False           # deterministic algorithms on, not warn-only
    math_reduced_precision: bool = False  # allow_fp16_bf16_reduction_math_sdp
    cudnn_deprioritized: bool = False     # TORCH_CUDNN_SDPA_DEPRIORITIZED

    @classmethod
    def current(cls) -> SdpSettings:
        """The settings in effect now (``torch.backends.cuda``, ``sdpa_kernel``)."""
        from memfit._torch import sdp_priority_order

        cuda = torch.backends.cuda
        flags = {SdpBackend.FLASH: cuda.flash_sdp_enabled(),
                 SdpBackend.EFFICIENT: cuda.mem_efficient_sdp_enabled(),
                 SdpBackend.MATH: cuda.math_sdp_enabled(),
                 SdpBackend.CUDNN: cuda.cudnn_sdp_enabled()}
        known = {b.value: b for b in SdpBackend}
        order = tuple(known[i] for i in sdp_priority_order() if i in known)
        env = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower()
        return cls(enabled=frozenset(b for b, on in flags.items() if on), order=order,
                   deterministic=(torch.are_deterministic_algorithms_enabled()
                                  and not torch.is_deterministic_algorithms_warn_only_enabled()),
                   math_reduced_precision=cuda.fp16_bf16_reduction_math_sdp_allowed(),
                   cudnn_deprioritized=env in ("1", "true", "on", "yes", "y"))


@dataclass(frozen=True)
class _Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    itemsize: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _Operand:
        return cls(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()),
                   str(t.dtype).removeprefix("torch."), t.element_size())


@dataclass(frozen=True)
class SdpaCall:
    """What the rules read of one ``scaled_dot_product_attention`` call."""

    q: _Operand
    k: _Operand
    v: _Operand
    mask: _Operand | None
    mask_requires_grad: bool
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool  # grad mode on and q, k or v requires grad

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           dropout_p: float, is_causal: bool, enable_gqa: bool) -> SdpaCall:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return cls(_Operand.of(q), _Operand.of(k), _Operand.of(v),
                   _Operand.of(mask) if mask is not None else None,
                   mask is not None and mask.requires_grad, float(dropout_p), bool(is_causal),
                   bool(enable_gqa), grad)


def _sm_in(arch: CudaArch, low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= (arch.major, arch.minor) <= high


def _dense(c: SdpaCall, gqa: bool, gqa_same_kv: bool, ignore_singleton: bool) -> str | None:
    """Rule 1 (after the 4-D check)."""
    q, k, v = c.q, c.k, c.v
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "q, k and v have different batch sizes"
    if c.enable_gqa and gqa:
        if gqa_same_kv and k.shape[1] != v.shape[1]:
            return "k and v have different numbers of heads"
        if q.shape[1] % k.shape[1] or (not gqa_same_kv and q.shape[1] % v.shape[1]):
            return "the heads of k and v do not divide those of q"
    elif not q.shape[1] == k.shape[1] == v.shape[1]:
        return "q, k and v have different numbers of heads" + ("" if gqa else " (no GQA here)")
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "a sequence length is 0"
    unit = q.stride[-1] == 1 and k.stride[-1] == 1 and v.stride[-1] == 1
    if not (unit or (ignore_singleton and q.shape[-1] == 1)):
        return "the last dimension of q, k or v has a stride other than 1"
    if c.mask is not None and c.mask.stride[-1] != 1:
        return "the last dimension of attn_mask has a stride other than 1"
    return None


def _flash(c: SdpaCall, arch: CudaArch) -> str | None:
    if len(c.q.shape) != 4 or len(c.k.shape) != 4 or len(c.v.shape) != 4:
        return "q, k and v are not all 4-D"
    if c.mask is not None:
        return "flash takes no attn_mask"
    d = c.q.shape[-1]
    if not (d == c.k.shape[-1] == c.v.shape[-1] and d <= 256):
        return f"head dims {c.q.shape[-1]}/{c.k.shape[-1]}/{c.v.shape[-1]}: flash needs one, at most 256"
    if not _sm_in(arch, (8, 0), (12, 1)):
        return f"sm{arch.major}{arch.minor} is outside sm80-sm121"
    consumer = _sm_in(arch, (8, 6), (8, 9)) or _sm_in(arch, (12, 0), (12, 1))
    if c.requires_grad and consumer and not (d <= 192 or (c.dropout_p == 0 and d > 224)):
        return f"training with head dim {d} on sm{arch.major}{arch.minor}"
    if c.is_causal and c.q.shape[2] != c.k.shape[2]:
        return "is_causal with as many queries as keys only"
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in _HALF):
        return f"dtype {c.q.dtype}: flash needs float16 or bfloat16"
    return _dense(c, gqa=True, gqa_same_kv=True, ignore_singleton=True)


def _gemm_alignment(c: SdpaCall, arch: CudaArch) -> int:
    half = c.q.dtype in _HALF
    tensor_cores = arch.major >= 8 or (arch.major >= 7 and half)
    align = 4 if arch.major >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _efficient(c: SdpaCall, arch: CudaArch) -> str | None:
    if not _sm_in(arch, (5, 0), (12, 1)):
        return f"sm{arch.major}{arch.minor} is outside sm50-sm121"
    if len(c.q.shape) != 4 or len(c.k.shape) != 4 or len(c.v.shape) != 4:
        return "q, k and v are not all 4-D"
    a = _gemm_alignment(c, arch)
    dq, dk, dv = c.q.shape[-1], c.k.shape[-1], c.v.shape[-1]
    if not (dq == dk and dq % a == 0 and dq > 0 and dv % a == 0 and dv > 0):
        return f"head dims {dq}/{dk}/{dv}: q and k equal, q and v multiples of {a}"
    if arch.major >= 8:
        for t in (c.q, c.k, c.v):
            if math.prod(t.shape) and (t.offset * t.itemsize) % (a * t.itemsize):
                return f"a storage offset is not aligned to {a * t.itemsize} bytes"
    problem = _dense(c, gqa=False, gqa_same_kv=True, ignore_singleton=False)
    if problem is not None:
        return problem
    allowed = ("float16", "float32", "bfloat16") if arch.major >= 8 else ("float16", "float32")
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in allowed):
        return f"dtype {c.q.dtype}: efficient needs one of {allowed}"
    return None


def _cudnn(c: SdpaCall, arch: CudaArch, settings: SdpSettings) -> str | None:
    cv = arch.cudnn_version
    if c.dropout_p > 0 and 91100 < cv < 91400:
        return "cuDNN 9.11-9.13 has no dropout in SDPA"
    if len(c.q.shape) != 4 or len(c.k.shape) != 4 or len(c.v.shape) != 4:
        return "q, k and v are not all 4-D"
    if settings.deterministic:
        return "cuDNN attention is not deterministic"
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in _HALF):
        return f"dtype {c.q.dtype}: cuDNN needs float16 or bfloat16"
    if c.mask is not None:
        m, (b, h, sq), sk = c.mask.shape, c.q.shape[:3], c.k.shape[2]
        ok = (not c.mask_requires_grad and m[-2] in (sq, 1) and m[-1] in (sk, 1)
              and (len(m) == 2 or (len(m) == 4 and m[0] in (1, b) and m[1] in (1, h))))
        if not ok:
            return f"attn_mask of shape {m}"
    if not _sm_in(arch, (8, 0), (12, 1)):
        return f"sm{arch.major}{arch.minor} is outside sm80-sm121"
    if c.dropout_p * 16 != math.floor(c.dropout_p * 16):
        return f"dropout {c.dropout_p} is not a multiple of 1/16"
    problem = _dense(c, gqa=True, gqa_same_kv=False, ignore_singleton=True)
    if problem is not None:
        return problem
    b, h, sq, dqk = c.q.shape
    sk, dv = c.k.shape[2], c.v.shape[3]
    if b > 65535 or h > 65535:
        return "batch or heads above 65535"
    sm90_10 = (arch.major == 9 and arch.minor == 0) or arch.major == 10
    limit = 128
    if sm90_10 and cv > 92200 and not (arch.major == 10 and arch.minor == 7 and cv <= 92500):
        limit = 256
    elif sm90_10 and cv >= 91100 and dqk == 192 and dv == 128:
        limit = 192
    if dqk > limit or dv > limit or dqk % 8 or dv % 8:
        return f"head dims {dqk}/{dv}: cuDNN needs multiples of 8, at most {limit}"
    if sk == 1 or (c.dropout_p != 0 and sq == 1):
        return "a sequence length of 1"
    if limit == 256 and c.requires_grad and not (
            (dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128), (256, 256))):
        return f"no cuDNN backward for head dims {dqk}/{dv}"
    return None


def _prefers_cudnn(arch: CudaArch, settings: SdpSettings) -> bool:
    if settings.cudnn_deprioritized or arch.cudnn_version <= 91500 or arch.major not in (9, 10):
        return False
    return arch.cuda_major >= 13 or arch.minor in (0, 3)


def problems(call: SdpaCall, arch: CudaArch,
             settings: SdpSettings) -> dict[SdpBackend, str | None]:
    """Why each backend cannot run this call on ``arch`` (None: it can), in the order tried
    (NOTE [SDPA backend choice])."""
    order = settings.order
    if order == _DEFAULT_ORDER and _prefers_cudnn(arch, settings):
        order = (SdpBackend.CUDNN, SdpBackend.FLASH, SdpBackend.EFFICIENT, SdpBackend.MATH)
    out: dict[SdpBackend, str | None] = {}
    for backend in order:
        if backend not in settings.enabled:
            out[backend] = "disabled"
        elif backend is SdpBackend.FLASH:
            out[backend] = _flash(call, arch)
        elif backend is SdpBackend.EFFICIENT:
            out[backend] = _efficient(call, arch)
        elif backend is SdpBackend.CUDNN:
            out[backend] = _cudnn(call, arch, settings)
        else:
            out[backend] = None
    return out


def select_backend(call: SdpaCall, arch: CudaArch, settings: SdpSettings) -> SdpBackend | None:
    """The backend CUDA runs this call with on ``arch`` (None: none can, CUDA raises).

    Example:
        >>> q = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="meta")
        >>> call = SdpaCall.of(q, q, q, None, 0.0, True, False)
        >>> on = SdpSettings(enabled=frozenset(SdpBackend))
        >>> select_backend(call, CUDA_ARCHS["a100"], on)
        <SdpBackend.FLASH: 1>
    """
    return next((b for b, why in problems(call, arch, settings).items() if why is None), None)
