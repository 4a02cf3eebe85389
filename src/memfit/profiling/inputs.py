"""Example inputs and the default loss: the edge between a user's model and a traced step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["normalize_inputs", "default_loss", "iter_tensors", "make_step_fn", "map_tensors"]

LossFn = Callable[[Any], torch.Tensor]


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
    """Every tensor in a nested structure (tuples, lists, dicts, dataclass-like HF outputs)."""
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


def make_step_fn(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 loss_fn: LossFn | None,
                 on_backward: Callable[[], None] | None = None) -> Callable[[], None]:
    """A step: forward, loss, backward. Output and loss stay referenced through backward, as in
    a usual training loop, and are released when the function returns."""
    lf = loss_fn or default_loss

    def step() -> None:
        out = model(*args, **kwargs)
        loss = lf(out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the loss must be a scalar tensor, got "
                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                "return e.g. out.sum() from loss_fn"
            )
        if on_backward is not None:
            on_backward()
        loss.backward()
        del out, loss

    return step
