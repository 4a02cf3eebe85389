"""GPU-faithful fake mode: the ops a CUDA device runs where the meta device takes CPU paths.

NOTE [CUDA kernels in fake mode]
    A fake-mode profile runs the step on the meta device. Most aten ops have one kernel
    signature on every device, and their meta kernels give the outputs (and so the saved
    tensors) of the CUDA kernel. Where a composite op chooses its kernel by device, the meta
    device takes the CPU branch, and a profile for a GPU target records what a CPU would keep.
    Fake tensors of device "cuda" would take the CUDA branches, but this CPU-only torch
    aborts the process on the first autograd node over one (``InputMetadata`` asks for a CUDA
    device guard: "PyTorch is not linked with support for cuda devices"), so for a CUDA target
    (``CUDA_ARCHS``: v100, a100, h100, h200) the trace runs under :class:`CudaKernels`, a
    ``TorchFunctionMode`` that calls the CUDA branch of those composites itself, with the
    real aten ops and their meta kernels; autograd saves and differentiates them as on CUDA.
    Measured against the CPU branch (torch 2.13):

    1. ``F.dropout`` (training, out of place, 0 < p < 1): CUDA runs ``aten.native_dropout``,
       keeping a bool mask (1 byte per element); the CPU branch draws ``bernoulli_`` into a
       mask of the input's dtype (2 bytes in bf16, 4 in fp32), which the ``mul`` saves.
       In-place, feature and alpha dropout take that branch on CUDA too: left as they are.
    2. ``F.scaled_dot_product_attention``: CUDA runs the backend torch's rules pick (NOTE
       [SDPA backend choice] in ``memfit.profiling.sdpa_rules``): flash, memory-efficient or
       cuDNN attention (saving q, k, v, the output, a logsumexp and the RNG state), or the
       math composite, whose dropout is then the fused one; meta always took the math
       composite with the CPU dropout (an s x s fp32 mask per head besides the softmax).
    3. Measured equal, nothing to do: convolution (``aten.convolution`` saves input and
       weight on both; cuDNN's and im2col's workspaces are transient), layer norm (the meta
       kernel already keeps fp32 mean and rstd of shape (..., 1) as CUDA does; a real CPU keeps
       them in bf16), group norm, softmax, log-softmax and cross entropy (``_log_softmax``,
       ``nll_loss_forward``: the log-probabilities, targets, total weight), embedding (saves
       the indices; CUDA's backward sorts them in a transient workspace), GELU, SiLU.
    4. Not modelled (op names or transients differ, saved bytes about equal): training
       batch norm runs ``cudnn_batch_norm`` on CUDA (same statistics, a reserve buffer, 0
       bytes without a fused activation) where meta runs ``native_batch_norm``;
       ``F.rms_norm`` runs the fused ``_fused_rms_norm`` kernel on CUDA (saves the input and
       an fp32 rstd) where meta decomposes it (saving the fp32 upcast of the input: about
       4 bytes per element more); ``softmax``/``log_softmax`` with ``dtype=float32`` of an
       fp16 CUDA tensor run one half-to-float kernel where meta casts first (a transient fp32
       copy of the input, the same output saved); ``torch.autocast("cuda")`` does nothing to
       meta tensors, so such a step is traced in float32 (NOTE [fake mode under autocast]).
       (Hugging Face models under fake tensors passed SDPA an explicit causal mask where on
       real tensors they pass ``is_causal=True``: now decided as on real tensors, NOTE [HF
       causal mask in fake mode] in ``memfit.profiling.hf_masks``.)
    5. Kernel temporaries (workspace, NOTE [kernel workspaces]) measured on an H200 (torch
       2.11, ``benchmarks.gpu_probe trace`` and ``benchmarks.gpu_kernel_temps``: the
       allocator's peak inside each op above what the op leaves): ``_softmax_backward_data``
       holds a temporary exactly as large as its output while it runs, on every one of 27
       shapes and dtypes measured (fp32, bf16, fp16; attention scores up to (4, 16, 2048,
       2048), vocabulary rows up to 1024 x 128,256); ``_log_softmax_backward_data`` holds
       none. The softmax's is where an eager-attention transformer's backward peaks:
       the zoo GPT's (8 layers, d 1024, 8 x 1024 tokens, fp32) measured peak was 318,768,128 B
       over its prediction before (2.2%; 13.1% under every-block checkpointing), and is
       1,016 B over it now (both). A fake-mode trace for a CUDA target gives that op this workspace
       (``cuda_workspace_bytes``). Not modelled: the column sums of bias gradients
       (``sum.dim_IntList``: none over 512 rows; over 2048 to 32768 rows 8 bytes per input
       element up to 132-136 MiB, 256 MiB at 32768 x 16384, alike in fp32 and bf16: a size
       set by the reduction's launch configuration and the device's 132 multiprocessors) and cuDNN's convolution workspaces (up to
       1,098,907,648 B in ResNet-50's backward at batch 184, by the algorithm cuDNN picks):
       a plan's measured peak may exceed its prediction by one of those where it sits at the
       peak; the whole-job reserve (NOTE [reserve] in ``memfit.planning.job``) covers them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from memfit._torch import cuda_fake_ops
from memfit.profiling.sdpa_rules import (
    CUDA_ARCHS,
    CudaArch,
    SdpaCall,
    SdpBackend,
    SdpSettings,
    select_backend,
)

__all__ = ["CudaKernels", "cuda_kernels_for", "cuda_workspace_bytes"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, 0.0, False, None, False)


def cuda_workspace_bytes(name: str, outputs: tuple[tuple[int, tuple[int, ...], str], ...]) -> int:
    """The temporary a CUDA kernel holds while it runs, beyond its outputs, for the ops NOTE
    [CUDA kernels in fake mode] (5) lists: ``outputs`` as a trace records them (storage,
    shape, dtype name); 0 for every other op.

    Example:
        >>> cuda_workspace_bytes("aten._softmax_backward_data.default", ((7, (2, 4, 8, 8), "float32"),))
        2048
        >>> cuda_workspace_bytes("aten.mm.default", ((7, (8, 8), "float32"),))
        0
    """
    if name != "aten._softmax_backward_data.default" or not outputs:
        return 0
    _, shape, dtype = outputs[0]
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def cuda_kernels_for(target: str) -> CudaKernels | None:
    """The mode for a fake-mode trace for ``target`` (None for a target that is no CUDA
    device, such as ``"cpu"``: its trace is left as it was)."""
    arch = CUDA_ARCHS.get(str(target).lower())
    return CudaKernels(arch) if arch is not None else None


class CudaKernels(TorchFunctionMode):
    """Runs dropout and attention on meta tensors as a CUDA device of ``arch`` would (NOTE
    [CUDA kernels in fake mode]); ``counts`` says what it rewrote ("native_dropout",
    "sdpa:flash"...)."""

    def __init__(self, arch: CudaArch) -> None:
        super().__init__()
        self.arch = arch
        self.ops = cuda_fake_ops()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out: Any = NotImplemented
        if func is F.dropout or func is torch.dropout:
            out = self._dropout(func, args, kwargs)
        elif func is F.scaled_dot_product_attention:
            out = self._sdpa(args, kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out

    # ---- 1. dropout ----------------------------------------------------------------------
    def _dropout(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        names: tuple[str, ...] = ("input", "p", "training", "inplace")
        defaults: tuple[Any, ...] = (0.5, True, False)
        if func is torch.dropout:
            names, defaults = ("input", "p", "train"), ()
        bound = _bind(names, defaults, args, kwargs)
        if bound is None:
            return NotImplemented
        x, p, train = bound[0], bound[1], bound[2]
        inplace = bound[3] if len(bound) > 3 else False
        fused = (isinstance(x, torch.Tensor) and x.device.type == "meta" and bool(train)
                 and not inplace and isinstance(p, (int, float)) and 0 < p < 1 and x.numel() > 0)
        if not fused:  # the branch CUDA shares with the CPU (or an error to raise as torch does)
            return NotImplemented
        self.counts["native_dropout"] += 1
        return torch.ops.aten.native_dropout.default(x, float(p), True)[0]

    # ---- 2. scaled_dot_product_attention --------------------------------------------------
    def _sdpa(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        bound = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
        if bound is None:
            return NotImplemented
        q, k, v, mask, p, causal, scale, gqa = bound
        tensors = (q, k, v) if mask is None else (q, k, v, mask)
        if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" and not t.is_nested
                   for t in tensors):
            return NotImplemented
        if not (q.dtype == k.dtype == v.dtype and min(q.dim(), k.dim(), v.dim()) >= 2) or (
                mask is not None and (causal or mask.dtype not in (torch.bool, q.dtype))):
            return NotImplemented  # torch raises its own error for these
        settings = SdpSettings.current()  # per call, as torch reads them (sdpa_kernel blocks)
        backend = select_backend(SdpaCall.of(q, k, v, mask, p, causal, gqa), self.arch, settings)
        if backend is None:
            raise RuntimeError("No available kernel. Aborting execution. (scaled_dot_product_"
                               f"attention on {self.arch.name}: every backend is refused or "
                               "disabled; NOTE [SDPA backend choice] in memfit.profiling."
                               "sdpa_rules)")
        self.counts[f"sdpa:{backend.name.lower()}"] += 1
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if backend is SdpBackend.FLASH:
            return self._flash(q, k, v, float(p), bool(causal), scale)
        if backend is SdpBackend.CUDNN:
            bias = _additive_mask(mask, q.dtype, torch.finfo(q.dtype).min)
            return self.ops["_scaled_dot_product_cudnn_attention"](
                q, k, v, bias, grad, float(p), bool(causal), False, scale=scale)[0]
        bias = _additive_mask(mask, q.dtype, -math.inf)
        if backend is SdpBackend.EFFICIENT:
            if bias is not None:
                bias = _pad_mask(bias, q, k)
            return self.ops["_scaled_dot_product_efficient_attention"](
                q, k, v, bias, grad, float(p), bool(causal), scale=scale)[0]
        return self._math(q, k, v, bias, float(p), bool(causal), scale, bool(gqa),
                          settings.math_reduced_precision)

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool,
               scale: float | None) -> torch.Tensor:
        d = q.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        if d % 8:  # pad_last_dim<8>, the output sliced back (post_process_flash_output)
            q, k, v = (F.pad(t, [0, 8 - d % 8]) for t in (q, k, v))
        out = self.ops["_scaled_dot_product_flash_attention"](
            q, k, v, p, causal, False, scale=og_scale)[0]
        return out.narrow(-1, 0, d) if d % 8 else out

    def _math(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, p: float,
              causal: bool, scale: float | None, gqa: bool, reduced: bool) -> torch.Tensor:
        """``_scaled_dot_product_attention_math`` as CUDA runs it: its dropout the fused one
        (``reduced``: fp16/bf16 kept, ``allow_fp16_bf16_reduction_math_sdp``)."""
        origin = q.dtype

        def acc(t: torch.Tensor) -> torch.Tensor:
            low = t.dtype in (torch.float16, torch.bfloat16)
            return t.to(torch.float32) if low and not reduced else t

        q, k, v = acc(q), acc(k), acc(v)
        negative = scale is not None and scale < 0
        factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        query = torch.ops.aten.mul.Scalar(q, -factor if negative else factor)
        if causal:
            ones = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
            mask = _additive_mask(ones.tril(), query.dtype, -math.inf)
        if gqa and not q.shape[-3] == k.shape[-3] == v.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        attn = torch.matmul(query, torch.ops.aten.mul.Scalar(k.transpose(-2, -1), factor))
        if mask is not None:
            attn.add_(mask)  # a CUDA tensor is no subclass: in place (NOTE [SDPA backend choice])
        attn = self.ops["_safe_softmax"](attn, -1)
        if p > 0:
            self.counts["native_dropout"] += 1
            attn = torch.ops.aten.native_dropout.default(attn, p, True)[0]
        # make_tuple(matmul(attn, v).to(origin), attn.to(origin)): torch's Linux builds (gcc)
        # evaluate the second first; scaled_dot_product_attention drops it
        attn.to(origin)
        return torch.matmul(attn, v).to(origin)


def _additive_mask(mask: Any, dtype: torch.dtype, neg: float) -> Any:
    """``convert_boolean_attn_mask``: a bool mask as 0 (attend) / ``neg``, in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.scalar_tensor(neg, dtype=dtype, device=mask.device))


def _pad_mask(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` for memory-efficient attention: expanded to (b, heads, s_q, s_k),
    keys padded to a multiple of 16 (then sliced back), or made contiguous if misaligned."""
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    s = bias.shape[-1]
    if s % 16:
        return F.pad(bias, [0, 16 - s % 16]).narrow(-1, 0, s)
    if any(st % 16 for st in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def _bind(names: tuple[str, ...], defaults: tuple[Any, ...], args: tuple,
          kwargs: dict[str, Any]) -> list[Any] | None:
    """The call's arguments in ``names`` order (trailing ones defaulted); None if it does
    not bind (the original function then raises its own error)."""
    if len(args) > len(names) or any(n not in names for n in kwargs):
        return None
    values = list(args)
    first_default = len(names) - len(defaults)
    for i in range(len(args), len(names)):
        if names[i] in kwargs:
            values.append(kwargs[names[i]])
        elif i >= first_default:
            values.append(defaults[i - first_default])
        else:
            return None
    if any(names[i] in kwargs for i in range(len(args))):
        return None
    return values
