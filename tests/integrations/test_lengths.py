"""The examples of other padded lengths made from one batch: padding kept, exact values."""

from __future__ import annotations

import pytest
import torch

from memfit.integrations.lengths import inputs_at_length, length_shapes


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])      # (batch, time), right-padded
    return {"input_ids": ids, "attention_mask": (ids != 0).long(),
            "labels": ids.masked_fill(ids == 0, -100), "num_items_in_batch": torch.tensor(6)}


@pytest.mark.parametrize("length, ids", [
    (2, [[5, 8], [9, 0]]),
    (4, [[5, 6, 7, 8], [9, 10, 0, 0]]),
    (6, [[5, 6, 7, 8, 8, 8], [9, 10, 0, 0, 0, 0]]),
], ids=["shorter", "same", "longer"])
def test_inputs_at_length_keeps_the_last_column(length, ids):
    out = inputs_at_length(_batch(), length)
    assert torch.equal(out["input_ids"], torch.tensor(ids))
    assert torch.equal(out["attention_mask"], (torch.tensor(ids) != 0).long())
    assert torch.equal(out["labels"], torch.tensor(ids).masked_fill(torch.tensor(ids) == 0, -100))
    assert torch.equal(out["num_items_in_batch"], torch.tensor(6))  # no sequence dimension


def test_inputs_at_length_resizes_a_lightning_batch():
    (ids,) = inputs_at_length([torch.arange(6).view(2, 3)], 5)
    assert torch.equal(ids, torch.tensor([[0, 1, 2, 2, 2], [3, 4, 5, 5, 5]]))


@pytest.mark.parametrize("kwargs, top, others", [
    ({"max_length": 16}, 16, [1, 8]),
    ({"shapes": [8, 32]}, 32, [8, 20]),
    ({"shapes": [8, 16, 32], "max_length": 64}, 64, [8, 16, 32]),
], ids=["max_length", "two_lengths", "lengths_and_max"])
def test_length_shapes(kwargs, top, others):
    example, rest = length_shapes(_batch(), **kwargs)
    assert example["input_ids"].shape == (2, top)
    assert [r["input_ids"].shape[1] for r in rest] == others


def test_length_shapes_refuses_bad_lengths():
    with pytest.raises(ValueError, match="max_length"):
        length_shapes(_batch())
    with pytest.raises(ValueError, match=">= 1"):
        length_shapes(_batch(), shapes=[0, 8])
    with pytest.raises(TypeError, match="two or more dimensions"):
        inputs_at_length({"x": torch.ones(3)}, 2)
