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
    are not device memory there (they are on a CPU; ``ASGD`` and ``Adagrad`` keep theirs on
    the device).

    ``state_dtype`` makes the twin's parameters (and gradients) that dtype, so its states
    are too: bf16 states of an fp32 model, fp32 states of a bf16 one. ``master_weights``
    adds an fp32 copy of every trainable parameter to the states (mixed precision keeps
    one) and steps the twin over fp32 copies, so that the step's temporaries are fp32.

NOTE [states made before the first step]
    The states are every storage the twin's ``state`` holds after its step: those its step
    made and those its constructor made (``Adagrad``'s ``state_sum`` and ``step`` exist from
    ``__init__``; they are live before the step, so the meter alone would not see them).

    Some steps read a tensor's value on the host (``.item()``: ``Adafactor``'s step count
    and norms, ``ASGD``'s ``mu``), which a fake tensor has none of (the fake mode knows the
    values of scalars made from Python constants, such as most step counters, and gives
    those). The step is run with every other such read answered 1 (``True``, ``1``,
    ``1.0``): the first step's step count, and ``ASGD``'s ``mu`` until its averaging starts.
    The states a step makes (their shapes and dtypes) do not depend on those values; which
    temporaries it makes can, so the step's transient bytes are the first step's. Only
    torch.optim's own classes are run so (a test steps every one of them for real); a class
    of yours that reads values is refused. ``SparseAdam`` takes sparse gradients only: its
    twin gets sparse gradients touching every row. Its states are counted exactly, but not
    its step's transients: they grow with the rows a gradient touches, which the fake mode
    takes as none (a real step over 1000 rows of 256 B made 1.54 MB of them, 6.0 x the rows'
    bytes); its name says so, and ``reserve=`` is where to put them.

    ``LBFGS`` is refused (``UNCOUNTABLE``): its state keeps a history of flat vectors that
    grows with each iteration (how many depends on the values), up to ``history_size``
    pairs. An optimizer whose twin cannot be made or stepped on fake tensors is refused too,
    naming it; give its bytes as ``optimizer=OptimizerMemory(name, state_bytes,
    step_bytes)`` (``memfit.profiling.profile``), or name a torch optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from memfit._torch import TorchDispatchMode
from memfit.ops import op_name
from memfit.profiling.fake import new_fake_mode
from memfit.profiling.model_state import dtype_name, local_part
from memfit.profiling.profile import OptimizerMemory, ParameterRecord, StorageKind
from memfit.profiling.storages import LiveStorages, storage_of

__all__ = ["optimizer_memory", "OPTIMIZER_NAMES", "UNCOUNTABLE", "parse_dtype"]

#: The optimizers ``optimizer=`` may name, and the torch class and hyper-parameters of each.
OPTIMIZER_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1}),
    "sgd-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3}),
}

#: torch optimizers memfit refuses to count, and why (NOTE [states made before the first step]).
UNCOUNTABLE: dict[str, str] = {
    "LBFGS": "its state keeps a history of flat parameter-sized vectors that grows with each "
             "iteration, by how many depends on the values (up to 2 x history_size of them)",
}


def optimizer_memory(optimizer: torch.optim.Optimizer | OptimizerMemory | str | None,
                     parameters: Sequence[ParameterRecord] = (), *,
                     state_dtype: torch.dtype | str | None = None, master_weights: bool = False,
                     cuda: bool = False) -> OptimizerMemory:
    """Measure what ``optimizer`` keeps and allocates (NOTE [optimizer memory on fake tensors]).

    Args:
        optimizer: an optimizer instance (its class and param groups), a name of
            ``OPTIMIZER_NAMES`` (over the trainable ``parameters``), an ``OptimizerMemory``
            (your own count, returned as given) or None (no optimizer).
        parameters: the model's parameters (``Profile.parameters``), for a name.
        state_dtype: the dtype of the states (default: each parameter's own, as torch does).
        master_weights: count an fp32 master copy of every trainable parameter.
        cuda: the job runs on a CUDA device (foreach by default; host-side step counters).

    Raises:
        ValueError: an optimizer memfit cannot count (``UNCOUNTABLE``, or one whose twin
            cannot be made or stepped on fake tensors), in one line naming it and what to
            pass instead.

    Example:
        >>> from memfit.profiling.profile import ParameterRecord
        >>> ps = [ParameterRecord("w", (1000,), "float32", 4000)]
        >>> optimizer_memory("sgd-momentum", ps).state_bytes
        4000
    """
    if optimizer is None:
        return OptimizerMemory.none()
    if isinstance(optimizer, OptimizerMemory):
        if state_dtype is not None or master_weights:
            raise ValueError(f"optimizer={optimizer!r} is a count of its own; "
                             "state_dtype and master_weights change a measured one: "
                             "count them in it and drop them")
        return optimizer
    dtype = parse_dtype(state_dtype)
    if master_weights:
        if dtype not in (None, torch.float32):
            raise ValueError(f"master_weights keeps fp32 copies and fp32 states; got "
                             f"state_dtype={state_dtype!r}: drop one of the two")
        dtype = torch.float32
    cls, groups, label = _recipe(optimizer, parameters)
    if label in UNCOUNTABLE:
        raise _uncountable(label, UNCOUNTABLE[label])
    if not any(g["params"] for g in groups):
        return OptimizerMemory(f"{label} (no trainable parameters)", 0, 0)
    if cuda:
        groups = [{**g, "foreach": True} if g.get("foreach") is None and not g.get("fused")
                  else g for g in groups]
    sparse = issubclass(cls, torch.optim.SparseAdam)
    with new_fake_mode():
        twins = [{**g, "params": [_twin(shape, dt if dtype is None else dtype, sparse)
                                  for shape, dt in g["params"]]} for g in groups]
        meter = LiveStorages()
        try:
            opt = cls(twins)
            for g in twins:
                for p in g["params"]:
                    meter.register(p, StorageKind.PARAMETER)
                    if not sparse:
                        meter.register(p.grad, StorageKind.GRADIENT)
            made_before = _state_storages(opt)  # NOTE [states made before the first step]
            for st in made_before.values():
                meter.register(torch.empty(0, device="cpu").set_(st), StorageKind.OTHER)
            with meter, _ValuesReadAsOne() if _own(cls) else contextlib.nullcontext():
                opt.step()
        except Exception as e:
            raise _uncountable(label, f"running it on fake tensors raised {type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}") from None
        finally:
            meter.close()
        created = sum(s.nbytes for s in meter.storages if s.created_by is not None and s.freed_after is None)
        states = created + sum(st.nbytes() for st in made_before.values())
        host = _host_state_bytes(opt) if cuda else 0
    masters = sum(_nbytes(shape, torch.float32) for g in groups for shape, _ in g["params"]) if master_weights else 0
    impl = _implementation(groups)
    dtypes = f"{dtype_name(dtype)} states" if dtype is not None else "states in the parameters' dtype"
    extras = (", fp32 master weights" if master_weights else "") + (
        ", step transients of sparse gradients not counted" if sparse else "")
    name = f"{label} ({impl}, {dtypes}{extras})"
    return OptimizerMemory(name, states - host + masters, max(0, meter.peak_bytes - created))


def _uncountable(label: str, why: str) -> ValueError:
    """The one-line refusal of an optimizer memfit cannot count."""
    return ValueError(
        f"memfit cannot count the memory of optimizer {label}: {why}; give your own count as "
        "optimizer=memfit.profiling.profile.OptimizerMemory(name, state_bytes, step_bytes), or a name "
        f"({'|'.join(OPTIMIZER_NAMES)}) with state_dtype=")


def _own(cls: type) -> bool:
    """Whether ``cls`` is one of torch.optim's, whose states the NOTE's argument covers (a test
    steps each): a class of yours is never run on guessed values."""
    return getattr(torch.optim, cls.__name__, None) is cls


class _ValuesReadAsOne(TorchDispatchMode):
    """Answers a tensor value read on the host (``.item()``, ``float(t)``) with 1, which a fake
    tensor cannot give (NOTE [states made before the first step])."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return func(*args, **(kwargs or {}))
        except Exception:  # the fake mode knows the values of scalars made from constants only
            if op_name(func) != "aten._local_scalar_dense.default":
                raise
            dtype = args[0].dtype
            return True if dtype is torch.bool else 1.0 if dtype.is_floating_point else 1


def _state_storages(opt: torch.optim.Optimizer) -> dict[int, torch.UntypedStorage]:
    """The storages of every tensor ``opt.state`` holds (in lists and dicts too), by id."""
    found: dict[int, torch.UntypedStorage] = {}

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            st = storage_of(v)
            if st is not None:
                found.setdefault(id(st), st)
            elif v.layout is not torch.strided:  # a sparse state: its parts
                visit([v.indices(), v.values()] if v.is_sparse else [])
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, list | tuple):
            for x in v:
                visit(x)

    visit(list(opt.state.values()))
    return found


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
        params = [(p.shape, parse_dtype(p.dtype)) for p in parameters if p.trainable]
        return getattr(torch.optim, cls_name), [{**hyper, "params": params}], cls_name
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, a name "
                        f"({sorted(OPTIMIZER_NAMES)}) or None, got {type(optimizer).__name__}")
    groups = []
    for g in optimizer.param_groups:
        params = [(tuple(local_part(p).shape), local_part(p).dtype) for p in g["params"] if p.requires_grad]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return type(optimizer), groups, type(optimizer).__name__


def _twin(shape: tuple[int, ...], dtype: torch.dtype | None, sparse: bool = False) -> torch.Tensor:
    """A fake parameter with a fake gradient; a sparse one touching every row for ``sparse``."""
    t = torch.empty(shape, dtype=dtype, device="cpu", requires_grad=True)
    if not sparse:
        t.grad = torch.empty_like(t)
    else:
        rows = shape[0] if shape else 1
        t.grad = torch.sparse_coo_tensor(torch.arange(rows).unsqueeze(0),
                                         torch.empty((rows, *shape[1:]), dtype=t.dtype), shape,
                                         check_invariants=False)
    return t


def _host_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the 0-d ``step`` counters torch keeps on the host (NOTE [optimizer memory on
    fake tensors]); 0 for fused or capturable groups, which keep them on the device."""
    total = 0
    if isinstance(opt, torch.optim.ASGD | torch.optim.Adagrad):  # their steps are on the device
        return 0
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


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype from ``torch.bfloat16``, ``"bfloat16"``, ``"bf16"`` or ``"torch.float32"``
    (None stays None); ValueError for a name torch does not know."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    dt = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {value!r}; give e.g. 'bfloat16' or 'float32'")
    return dt

