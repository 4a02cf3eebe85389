"""Example inputs and the default loss: the edge between a user's model and a traced step."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from memfit._torch import tree_flatten, tree_map
from memfit.errors import MemfitError, ModelError

__all__ = ["normalize_inputs", "default_loss", "iter_tensors", "map_tensors",
           "call_user", "InputSignature", "input_signature", "call_signature", "PARAMETERS_KEY",
           "first_floating_parameter"]

LossFn = Callable[[Any], torch.Tensor]

# NOTE [input signature] What a planned step's memory depends on beyond the model's code: the
# shape and dtype of each tensor the model's forward is called with (positional arguments by
# position, keyword ones by name, in name order, nested tuples, lists and dicts by index or
# key: "0", "input_ids", "0.1"), and the dtype of its parameters (under PARAMETERS_KEY, shape
# ()). A profile records it for the root module's first call; the plan carries it, and a
# planned model warns on the first call whose signature differs (memfit.runtime.shapes).
InputSignature = tuple[tuple[str, tuple[int, ...], str], ...]
PARAMETERS_KEY = "<parameters>"


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any],
                   parameter: torch.Tensor | None = None) -> list[tuple[str, Any, Any]]:
    """``(name, shape, dtype)`` of each tensor of one call (NOTE [input signature]), as
    ``torch.Size`` and ``torch.dtype``; ``parameter``: a floating parameter of the model,
    whose dtype stands for all of them.

    Example:
        >>> call_signature((torch.ones(2, 3),), {"mask": [torch.ones(2, dtype=torch.bool)]})
        [('0', torch.Size([2, 3]), torch.float32), ('mask.0', torch.Size([2]), torch.bool)]
    """
    out: list[tuple[str, Any, Any]] = []

    def walk(name: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append((name, v.shape, v.dtype))
        elif isinstance(v, (tuple, list)):
            for i, x in enumerate(v):
                walk(f"{name}.{i}", x)
        elif isinstance(v, Mapping):
            for k in sorted(v, key=str):
                walk(f"{name}.{k}", v[k])

    for i, a in enumerate(args):
        walk(str(i), a)
    for k in sorted(kwargs):
        walk(k, kwargs[k])
    if parameter is not None:
        out.append((PARAMETERS_KEY, torch.Size(()), parameter.dtype))
    return out


def input_signature(args: tuple[Any, ...], kwargs: dict[str, Any],
                    parameter: torch.Tensor | None = None) -> InputSignature:
    """:func:`call_signature` as plain data (shapes as int tuples, dtypes as names).

    Example:
        >>> input_signature((torch.ones(2, 3),), {})
        (('0', (2, 3), 'float32'),)
    """
    return tuple((name, tuple(int(d) for d in shape), str(dtype).removeprefix("torch."))
                 for name, shape, dtype in call_signature(args, kwargs, parameter))


def first_floating_parameter(model: torch.nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter of ``model`` (None: it has none)."""
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def normalize_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn a tensor, a tuple/list of positional args or a dict of kwargs into ``(args, kwargs)``.

    Example:
        >>> normalize_inputs(torch.ones(2))[0][0].shape
        torch.Size([2])
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, Mapping):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TypeError(
                f"example_inputs as a dict must map argument names (str) to values, got keys "
                f"{[type(k).__name__ for k in example_inputs][:5]}"
            )
        return (), dict(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(example_inputs).__name__}"
    )


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested structure: tuples (NamedTuples too), lists, dicts, dataclasses
    (HF ``ModelOutput`` is both a dict and a dataclass) and pytree-registered containers.

    Example:
        >>> [t.shape for t in iter_tensors({"a": (torch.ones(2), 3), "b": [torch.ones(1)]})]
        [torch.Size([2]), torch.Size([1])]
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, Mapping):  # HF ModelOutput is an OrderedDict subclass
        for v in obj.values():
            yield from iter_tensors(v)
        return
    if isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # the fields themselves, not dataclasses.asdict (which deep-copies every tensor)
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None))
        return
    leaves, _ = tree_flatten(obj)
    if len(leaves) == 1 and leaves[0] is obj:
        return
    for leaf in leaves:
        yield from iter_tensors(leaf)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor of a (args, kwargs) style structure."""
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, obj)


def default_loss(output: Any) -> torch.Tensor:
    """The loss memfit differentiates when no ``loss_fn`` is given.

    ``output.loss`` when the output carries one (Hugging Face style), else the sum of
    ``t.sum()`` over the floating-point output tensors that require grad (all floating tensors
    if none does).

    Example:
        >>> default_loss((torch.ones(2), torch.ones(3))).item()
        5.0
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for t in iter_tensors(output) if t.is_floating_point() or t.is_complex()]
    grads = [t for t in tensors if t.requires_grad]
    use = grads or tensors
    if not use:
        raise TypeError(
            f"cannot build a default loss: the model returned {type(output).__name__} with no "
            "floating-point tensor; pass loss_fn=lambda out: <scalar tensor>"
        )
    total = use[0].sum()
    for t in use[1:]:
        total = total + t.sum()
    return total


# NOTE [whose fault]
#     memfit runs the user's code (the model's forward, a loss_fn, the backward through them)
#     with its own code inside it (module hooks, a dispatch mode, saved-tensor hooks). An
#     exception escaping that call is the model's -- a ``ModelError`` (bad input, CLI exit 2),
#     the original as ``__cause__`` -- unless memfit raised it:
#     1. a ``MemfitError`` passes through unchanged (memfit raised it on purpose);
#     2. any other exception whose innermost traceback frame is a file of the memfit package
#        is a bug in memfit and passes through unchanged (CLI exit 4);
#     3. a CUDA out-of-memory error passes through unchanged (neither party's bug).
#     An op that fails (a shape mismatch) raises from torch's op call even when memfit's
#     dispatch mode forwarded it, so it counts as the model's. The rule misjudges a memfit bug
#     that passes bad arguments to a torch Python function; its traceback is still the
#     ``__cause__`` (``--debug`` on the command line).

_MEMFIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raised_in_memfit(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by memfit's own code (its innermost frame is in the package)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return path.startswith(_MEMFIT_DIR + os.sep)


def model_name(model: Any) -> str:
    """A model's name for messages: its class name (a function's qualified name)."""
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return str(getattr(model, "__qualname__", type(model).__name__))


def call_user(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
              model: str, what: str) -> Any:
    """``fn(*args, **kwargs)``, where ``fn`` is the user's code; what it raises becomes a
    ``ModelError`` naming ``model`` and ``what`` ran (NOTE [whose fault]).

    Example:
        >>> call_user(torch.nn.Linear(2, 1), (torch.ones(1, 3),), {}, model="Linear",
        ...           what="forward")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        memfit.errors.ModelError: Linear's forward raised RuntimeError: mat1 and mat2 ...
    """
    try:
        return fn(*args, **kwargs)
    except (MemfitError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        if raised_in_memfit(e):
            raise
        lines = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {lines[0].rstrip('.')}" if lines else type(e).__name__
        raise ModelError(
            f"{model}'s {what} raised {detail} -- an error of the model or its example inputs, "
            "not of memfit: check that the step runs on these inputs without memfit",
            model=model,
        ) from e


def check_differentiable(loss: torch.Tensor, model: Any, name: str, inputs: Any,
                          user_loss: bool) -> None:
    """A loss that does not require grad has no backward: say why instead of torch's
    "element 0 of tensors does not require grad"."""
    if loss.requires_grad:
        return
    if not torch.is_grad_enabled():
        why = "gradients are disabled (the step ran under torch.no_grad() or inference_mode)"
        fix = "call memfit outside torch.no_grad()"
    else:
        n = (sum(1 for p in model.parameters() if p.requires_grad)
             if isinstance(model, torch.nn.Module) else None)
        params = (f"{name} has no trainable parameter" if n == 0 else
                  "no trainable parameter reaches the loss")
        if any(t.requires_grad for t in iter_tensors(inputs)):
            why = f"{params} and the example inputs that require grad do not reach the loss"
        else:
            why = f"{params} and no example input has requires_grad=True"
        if user_loss:
            why += ", or loss_fn detached the output"
        fix = "give the model trainable parameters or pass an input with requires_grad=True"
    raise ModelError(
        f"nothing in {name}'s training step requires grad: {why}, so there is no backward "
        f"pass and nothing to checkpoint; {fix}",
        model=name,
    )
