"""What memfit marks on a module: ``applied_plan`` and ``carries_plan`` (``memfit.runtime.marks``)."""

from __future__ import annotations

import torch
from torch import nn

import memfit
from memfit.planning.plan import Plan, Region
from memfit.runtime.apply import apply_plan, unapply
from memfit.runtime.marks import applied_plan, carries_plan
from memfit.runtime.wrap import unwrap, wrap


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _plan() -> Plan:
    return Plan(regions=(Region(("1",)),), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="test", profile_signature="", extra={"module_types": {}})


def test_applied_plan_is_the_plan_on_the_planned_module_only():
    model, plan = _model(), _plan()
    assert applied_plan(model) is None and not carries_plan(model)
    apply_plan(model, plan)
    assert applied_plan(model) is plan and memfit.applied_plan(model) is plan
    assert applied_plan(model[1]) is None  # checkpointed by the plan, but not where it was applied
    assert carries_plan(model)
    unapply(model)
    assert applied_plan(model) is None and not carries_plan(model)


def test_a_module_wrapped_by_hand_carries_no_applied_plan():
    model = _model()
    wrap(model[1])
    assert applied_plan(model) is None and applied_plan(model[1]) is None
    assert carries_plan(model)
    unwrap(model[1])
    assert not carries_plan(model)
