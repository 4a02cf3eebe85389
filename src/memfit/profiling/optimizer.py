"""What an optimizer keeps and allocates on the device, measured on fake tensors.

NOTE [optimizer memory on fake tensors]
    The optimizer's own code is run, not a formula of it: a twin of the optimizer (its class,
    its param groups' hyper-parameters) is made over fake tensors shaped like its parameters,
    each with a fake gradient, and one ``step()`` is traced with the live-storage meter
    (``LiveStorages``). The first step allocates every state, so what is live after it is
    the states, and its peak over the states is the step's transient memory: torch's choice
    of implementation (single-tensor, foreach, fused), weight decay, AMSGrad, momentum all
    count as they run. Fake tensors hold no memory, so a 7B model's optimizer is measured
    here in well under a second, and the caller's optimizer is never touched.

    The twins are fake CPU tensors (fused kernels have no meta implementation). On a CUDA
    target torch would pick the foreach implementation where the user left the choice open
    (``foreach=None`` and not ``fused``), so the twin is given ``foreach=True``; and Adam's
    ``step`` counters, scalars torch keeps on the host unless ``capturable`` or ``fused``,
    are not device memory there (they are on a CPU).

    ``state_dtype`` makes the twin's parameters (and gradients) that dtype, so its states
    are too: bf16 states of an fp32 model, fp32 states of a bf16 one. ``master_weights``
    adds an fp32 copy of every trainable parameter to the states (mixed precision keeps
    one) and steps the twin over fp32 copies, so that the step's temporaries are fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memfit.planning.job import OptimizerMemory
from memfit.profiling.fake import new_fake_mode
from memfit.profiling.model_state import dtype_name, local_part
from memfit.profiling.profile import ParameterRecord, StorageKind
from memfit.profiling.storages import LiveStorages, storage_of

__all__ = ["optimizer_memory", "OPTIMIZER_NAMES"]

#: The optimizers ``optimizer=`` may name, and the torch class and hyper-parameters of each.
OPTIMIZER_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1}),
    "sgd-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3}),
}


def optimizer_memory(optimizer: torch.optim.Optimizer | str | None,
                     parameters: Sequence[ParameterRecord] = (), *,
                     state_dtype: torch.dtype | str | None = None, master_weights: bool = False,
                     cuda: bool = False) -> OptimizerMemory:
    """Measure what ``optimizer`` keeps and allocates (NOTE [optimizer memory on fake tensors]).

    Args:
        optimizer: an optimizer instance (its class and param groups), a name of
            ``OPTIMIZER_NAMES`` (over the trainable ``parameters``), or None (no optimizer).
        parameters: the model's parameters (``Profile.parameters``), for a name.
        state_dtype: the dtype of the states (default: each parameter's own, as torch does).
        master_weights: count an fp32 master copy of every trainable parameter.
        cuda: the job runs on a CUDA device (foreach by default; host-side step counters).

    Example:
        >>> from memfit.profiling.profile import ParameterRecord
        >>> ps = [ParameterRecord("w", (1000,), "float32", 4000)]
        >>> optimizer_memory("sgd-momentum", ps).state_bytes
        4000
    """
    if optimizer is None:
        return OptimizerMemory.none()
    dtype = _dtype(state_dtype)
    if master_weights:
        if dtype not in (None, torch.float32):
            raise ValueError(f"master_weights keeps fp32 copies and fp32 states; got "
                             f"optimizer_state_dtype={state_dtype!r}: drop one of the two")
        dtype = torch.float32
    cls, groups, label = _recipe(optimizer, parameters)
    if not any(g["params"] for g in groups):
        return OptimizerMemory(f"{label} (no trainable parameters)", 0, 0)
    if cuda:
        groups = [{**g, "foreach": True} if g.get("foreach") is None and not g.get("fused")
                  else g for g in groups]
    with new_fake_mode():
        twins = [{**g, "params": [_twin(shape, dt if dtype is None else dtype)
                                  for shape, dt in g["params"]]} for g in groups]
        try:
            opt = cls(twins)
        except Exception as e:
            raise ValueError(
                f"cannot measure {label}: making a twin of it over fake tensors raised "
                f"{type(e).__name__}: {e}. Name a torch optimizer instead "
                f"(optimizer={'|'.join(map(repr, OPTIMIZER_NAMES))}, with "
                "optimizer_state_dtype=)") from None
        meter = LiveStorages()
        for g in twins:
            for p in g["params"]:
                meter.register(p, StorageKind.PARAMETER)
                meter.register(p.grad, StorageKind.GRADIENT)
        with meter:
            opt.step()
        meter.close()
        created = sum(s.nbytes for s in meter.storages if s.created_by is not None and s.freed_after is None)
        host = _host_state_bytes(opt) if cuda else 0
    masters = sum(_nbytes(shape, torch.float32) for g in groups for shape, _ in g["params"]) if master_weights else 0
    impl = _implementation(groups)
    states = f"{dtype_name(dtype)} states" if dtype is not None else "states in the parameters' dtype"
    name = f"{label} ({impl}, {states}{', fp32 master weights' if master_weights else ''})"
    return OptimizerMemory(name, created - host + masters, max(0, meter.peak_bytes - created))


def _recipe(optimizer: torch.optim.Optimizer | str, parameters: Sequence[ParameterRecord]
            ) -> tuple[type, list[dict[str, Any]], str]:
    """The optimizer class, its groups (hyper-parameters, ``(shape, dtype)`` per parameter
    that gets a gradient) and a label."""
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown optimizer {optimizer!r}; name one of "
                             f"{sorted(OPTIMIZER_NAMES)} or pass the optimizer itself")
        cls_name, hyper = OPTIMIZER_NAMES[key]
        params = [(p.shape, _dtype(p.dtype)) for p in parameters if p.trainable]
        return getattr(torch.optim, cls_name), [{**hyper, "params": params}], cls_name
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a name "
                        f"({sorted(OPTIMIZER_NAMES)}) or None, got {type(optimizer).__name__}")
    groups = []
    for g in optimizer.param_groups:
        params = [(tuple(local_part(p).shape), local_part(p).dtype) for p in g["params"] if p.requires_grad]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return type(optimizer), groups, type(optimizer).__name__


def _twin(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device="cpu", requires_grad=True)
    t.grad = torch.empty_like(t)
    return t


def _host_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the 0-d ``step`` counters torch keeps on the host (NOTE [optimizer memory on
    fake tensors]); 0 for fused or capturable groups, which keep them on the device."""
    total = 0
    for g in opt.param_groups:
        if g.get("fused") or g.get("capturable"):
            continue
        for p in g["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0 and storage_of(step) is not None:
                total += step.element_size()
    return total


def _implementation(groups: list[dict[str, Any]]) -> str:
    g = groups[0]
    return "fused" if g.get("fused") else "foreach" if g.get("foreach") else "single-tensor"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    dt = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {value!r}; give e.g. 'bfloat16' or 'float32'")
    return dt

