"""memfit.measuring.twins: a step on a plain or planned copy of the model, measured; the model left as
found."""

from __future__ import annotations

import torch
from torch import nn

from memfit import zoo
from memfit.measuring.twins import plain_copy, record_step, twin_step
from memfit.planning.plan import Plan, Region
from memfit.runtime.apply import apply_plan
from memfit.step.harness import Step


def _plan(*paths: str) -> Plan:
    return Plan(regions=tuple(Region((p,)) for p in paths), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="hand", profile_signature="")


def _gpt() -> nn.Module:
    return zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)


def test_plain_copy_of_a_planned_model_carries_no_plan_and_leaves_the_plan_on():
    model = _gpt()
    plan = _plan("blocks.0")
    apply_plan(model, plan)
    twin = plain_copy(model)
    assert "memfit_plan" not in twin.__dict__ and model.memfit_plan is plan
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b) and a is not b, n


def test_twins_of_one_step_match_bitwise_and_leave_the_model_alone():
    model = _gpt()
    x = zoo.example_inputs(model, batch=2)
    step = Step.of(model, x)
    plain = twin_step(step, None)
    planned = twin_step(step, _plan("blocks.0", "blocks.1"))
    assert plain.model is not model and planned.model.memfit_plan.solver == "hand"
    assert plain.args[0] is not x and torch.equal(plain.args[0], x)
    ref, got = record_step(plain, seed=7), record_step(planned, seed=7)
    assert torch.equal(ref.loss, got.loss) and torch.equal(ref.rng_after, got.rng_after)
    assert ref.param_grads.keys() == got.param_grads.keys()
    for n, g in ref.param_grads.items():
        assert torch.equal(g, got.param_grads[n]), n
    assert 0 < got.peak_bytes < ref.peak_bytes  # two blocks checkpointed
    assert len(ref.times_s) == 1 and ref.times_s[0] > 0
    assert all(p.grad is None for p in model.parameters())
    assert "memfit_plan" not in model.__dict__
