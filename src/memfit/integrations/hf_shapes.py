"""Plans for every padded length of a Hugging Face model's batches (``max_length=``,
``shapes=`` of ``hf.enable`` and ``MemfitCallback``).

NOTE [planning for dynamic padding]
    A collator that pads each batch to its longest row (``DataCollatorWithPadding``,
    ``DataCollatorForLanguageModeling``) calls the model on another sequence length at almost
    every step; a plan made for one length holds its budget for that length only (NOTE
    [inputs other than the profiled ones] in ``memfit.runtime.shapes``). So the step is
    planned for a range of lengths up front, with ``fit(shapes=...)`` (NOTE [shape ranges]
    in ``memfit.shape_plans``):

    1. the lengths are ``shapes`` (sequence lengths), and ``max_length``; with ``max_length``
       alone, ``1`` and ``max_length``. With two lengths their midpoint is profiled too
       (corners and middle). The longest is the plan's own example: a fractional budget
       (``0.5``) is a fraction of the plain peak at that length.
    2. the example of each length is made from the given inputs (or the first training
       batch) by :func:`inputs_at_length`: every tensor whose size along dimension 1 is the
       batch's sequence length keeps its first ``length - 1`` columns and its last one
       (shortening), or repeats its last column (lengthening). The last column of a
       right-padded batch, the first of a left-padded one, are padding: both kept, every
       example carries the padding (an attention mask with zeros, labels of -100) of the
       batch it was made from, so the model runs the masked attention path at every length.
    3. every length between the shortest and the longest then runs a plan whose predicted
       peak fits the budget at both ends of its range, switched to by the input guard
       without a trace: no re-plan during training. A length outside the range (or another
       batch size, a last batch left short: ``dataloader_drop_last=True`` avoids it) goes to
       ``on_new_shape``, ``"replan"`` by default: one profile per new shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["inputs_at_length", "length_shapes"]


def _seq_len(inputs: Mapping[str, Any]) -> int:
    if not isinstance(inputs, Mapping):
        raise TypeError("max_length=/shapes= resize keyword inputs (a dict, as the Trainer passes "
                        f"them), got {type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2),
                   None)
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        raise TypeError("max_length=/shapes= resize the inputs' sequence dimension (dimension 1 "
                        f"of input_ids); got inputs {sorted(inputs)} without a 2-D tensor")
    return int(ids.shape[1])


def inputs_at_length(inputs: Mapping[str, Any], length: int) -> dict[str, Any]:
    """``inputs`` (keyword inputs of one step) with their sequence dimension resized to
    ``length``, the padding kept (NOTE [planning for dynamic padding], rule 2).

    Example:
        >>> x = {"input_ids": torch.tensor([[5, 6, 7, 0]]), "labels": torch.tensor([[5, 6, 7, -100]])}
        >>> inputs_at_length(x, 2)["labels"], inputs_at_length(x, 6)["input_ids"]
        (tensor([[   5, -100]]), tensor([[5, 6, 7, 0, 0, 0]]))

    Raises:
        TypeError: inputs without a 2-D tensor to take the sequence length from.
        ValueError: ``length`` below 1.
    """
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"a sequence length must be an int >= 1, got {length!r}")
    seq = _seq_len(inputs)
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq):
            out[name] = value
        elif length <= seq:
            out[name] = torch.cat([value[:, :length - 1], value[:, -1:]], dim=1).contiguous()
        else:
            tail = value[:, -1:].expand(-1, length - seq, *value.shape[2:])
            out[name] = torch.cat([value, tail], dim=1).contiguous()
    return out


def length_shapes(inputs: Mapping[str, Any], *, max_length: int | None = None,
                  shapes: Sequence[int] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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
