"""Accelerate: ``Accelerator().prepare`` of a fitted model trains bitwise like the plain one."""

from __future__ import annotations

import pytest
import torch
from hf_models import assert_same_weights, batch, llama

import memfit

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.hf


def _train_prepared(model: torch.nn.Module, steps: int = 3) -> torch.nn.Module:
    accelerator = accelerate.Accelerator(cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, opt = accelerator.prepare(model, opt)
    torch.manual_seed(0)
    for i in range(steps):
        loss = prepared(**batch(seed=100 + i)).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return accelerator.unwrap_model(prepared)


@pytest.mark.slow
def test_prepare_of_a_fitted_model_trains_bitwise():
    fitted = memfit.fit(llama(), batch(), budget=0.5)
    ours = _train_prepared(fitted)
    assert ours is fitted and ours.memfit_plan.regions  # prepare kept the planned model
    assert_same_weights(ours, _train_prepared(llama()))
