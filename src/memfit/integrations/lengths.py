"""Plans for every padded length of a model's batches: ``max_length=`` and ``shapes=`` of
``hf.enable``, of the Trainer's ``MemfitCallback`` and (``max_length=``) of Lightning's.

NOTE [planning for dynamic padding]
    A collator that pads each batch to its longest row (``DataCollatorWithPadding``,
    ``DataCollatorForLanguageModeling``) calls the model on another sequence length at almost
    every step; a plan made for one length holds its budget for that length only (NOTE
    [inputs other than the profiled ones] in ``memfit.runtime.shapes``). So the step is
    planned for a range of lengths up front, with ``fit(shapes=...)`` (NOTE [shape ranges]
    in ``memfit.job.shape_plans``):

    1. the lengths are ``shapes`` (sequence lengths), and ``max_length``; with ``max_length``
       alone, ``1`` and ``max_length``. With two lengths their midpoint is profiled too
       (corners and middle). The longest is the plan's own example: a fractional budget
       (``0.5``) is a fraction of the plain peak at that length.
    2. the example of each length is made from the given inputs (or the first training
       batch) by :func:`inputs_at_length`: every tensor whose size along dimension 1 is the
       batch's sequence length (that of ``input_ids``, else of the first tensor of two or
       more dimensions) keeps its first ``length - 1`` columns and its last one
       (shortening), or repeats its last column (lengthening). The last column of a
       right-padded batch, the first of a left-padded one, are padding: both kept, every
       example carries the padding (an attention mask with zeros, labels of -100) of the
       batch it was made from, so the model runs the masked attention path at every length.
    3. every length between the shortest and the longest then runs a plan whose predicted
       peak fits the budget at both ends of its range, switched to by the input guard
       without a trace: no re-plan during training. A length outside the range (or another
       batch size, a last batch left short: ``dataloader_drop_last=True`` avoids it) goes to
       ``on_new_shape``, ``"replan"`` by default: one profile per new shape.
    4. Lightning's callback plans a ``training_step`` (a callable: no input guard, NOTE
       [planning a training_step] in ``memfit.integrations.lightning``): it plans the batch
       resized to ``max_length`` only, and every shorter batch runs that plan. This assumes
       the step's peak does not fall as the length grows (true of the transformers we test,
       whose activations grow with the length); the monitor (``monitor_every=``) checks it
       on the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["inputs_at_length", "length_shapes"]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        first = [x["input_ids"]] if isinstance(x.get("input_ids"), torch.Tensor) else []
        return first + [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _seq_len(inputs: Any) -> int:
    ids = next((t for t in _tensors(inputs) if t.dim() >= 2), None)
    if ids is None:
        raise TypeError("max_length=/shapes= resize the inputs' sequence dimension (dimension 1 "
                        f"of input_ids, or of the first 2-D tensor); got {type(inputs).__name__} "
                        "without a tensor of two or more dimensions")
    return int(ids.shape[1])


def _resized(x: Any, seq: int, length: int) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dim() < 2 or x.shape[1] != seq:
            return x
        if length <= seq:
            return torch.cat([x[:, :length - 1], x[:, -1:]], dim=1).contiguous()
        return torch.cat([x, x[:, -1:].expand(-1, length - seq, *x.shape[2:])], dim=1)
    if isinstance(x, Mapping):
        return {k: _resized(v, seq, length) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_resized(v, seq, length) for v in x)
    if isinstance(x, list):
        return [_resized(v, seq, length) for v in x]
    return x


def inputs_at_length(inputs: Any, length: int) -> Any:
    """``inputs`` (one step's inputs or batch: a tensor, or a dict, tuple or list of them)
    with their sequence dimension resized to ``length``, the padding kept (NOTE [planning for
    dynamic padding], rule 2).

    Example:
        >>> x = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "labels": torch.tensor([[5, 6, 7, -100]])}
        >>> inputs_at_length(x, 2)["labels"], inputs_at_length(x, 6)["input_ids"]
        (tensor([[   5, -100]]), tensor([[5, 6, 7, 0, 0, 0]]))

    Raises:
        TypeError: inputs without a tensor of two or more dimensions.
        ValueError: ``length`` below 1.
    """
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"a sequence length must be an int >= 1, got {length!r}")
    return _resized(inputs, _seq_len(inputs), length)


def length_shapes(inputs: Any, *, max_length: int | None = None,
                  shapes: Sequence[int] | None = None) -> tuple[Any, list[Any]]:
    """The example of the longest length and the examples of the others, for
    ``fit(example, shapes=others)`` (NOTE [planning for dynamic padding], rule 1).

    Example:
        >>> x = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
        >>> top, others = length_shapes(x, max_length=16)
        >>> top["input_ids"].shape[1], [o["input_ids"].shape[1] for o in others]
        (16, [1, 8])

    Raises:
        ValueError: neither ``max_length`` nor ``shapes`` given, or a length below 1.
    """
    lengths = set(shapes or ())
    if max_length is not None:
        lengths.add(max_length)
    if not lengths:
        raise ValueError("give max_length= (the longest padded length) or shapes= (lengths)")
    if shapes is None or len(lengths) == 1:
        lengths.add(1)
    for n in lengths:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"sequence lengths must be ints >= 1, got {n!r}")
    ordered = sorted(lengths)
    if len(ordered) == 2:
        ordered.insert(1, (ordered[0] + ordered[1]) // 2)
    top = inputs_at_length(inputs, ordered[-1])
    return top, [inputs_at_length(inputs, n) for n in ordered[:-1]]
