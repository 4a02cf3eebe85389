"""PEFT LoRA: plans count only the gradients of what trains; fit after get_peft_model."""

from __future__ import annotations

import pytest
import torch
from hf_models import assert_same_weights, batch, llama, train

import memfit
from memfit.integrations import hf

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.hf


def lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)  # LoRA's A matrices are random
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return peft.get_peft_model(model, config)


@pytest.mark.slow
def test_fit_lora_verifies_bitwise_and_trains_bitwise():
    model = memfit.fit(lora(llama()), batch(), budget=0.5)
    report = memfit.verify(model, batch())
    assert report.ok and report.bitwise, str(report)
    assert report.peak_bytes <= report.budget_bytes * 1.03
    assert_same_weights(train(model), train(lora(llama())))


@pytest.mark.slow
def test_lora_plan_counts_only_lora_gradients():
    from memfit.profiling.profile import StorageKind

    model = lora(llama())
    plan = memfit.fit(model, batch(), budget=0.5, search=memfit.Search(solver="chain")).memfit_plan
    memfit.unapply(model)
    prof = memfit.profile(model, {**batch(), "use_cache": False})  # the step fit profiled
    # gradients alive at the end of the step are the parameters' own: LoRA's, to the byte
    kept = sum(s.nbytes for s in prof.storages
               if s.kind is StorageKind.GRADIENT and s.freed_after is None)
    lora_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert kept == lora_bytes == 21504  # r=4 A and B of q_proj and v_proj, 6 layers, float32
    assert plan.plain_peak_bytes == prof.peak_bytes


@pytest.mark.slow
def test_fit_before_get_peft_model_replans_the_wrapped_model():
    base = memfit.fit(llama(), batch(), budget=0.5, search=memfit.Search(solver="chain"))
    model = lora(base)
    stale = memfit.verify(model, batch())  # the plan names paths the wrapper moved
    assert not stale.ok and "PlanMismatch" in stale.failures[0].detail
    hf.enable(model, budget=0.5, example_inputs=batch(), solver="chain")
    assert "memfit_plan" not in base.__dict__
    assert all(p.startswith("base_model.model.") for r in model.memfit_plan.regions for p in r.modules)
    assert memfit.verify(model, batch()).ok
