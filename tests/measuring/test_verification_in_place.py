"""verify on a model that has no twin (NOTE [models without twins] in ``memfit.measuring.twins``): both
steps on the model itself, its plan lifted for the plain one, and the model left as it was.

Here the model cannot be deep-copied (it holds a lock); FSDP-sharded and DDP models take the
same path, tested on 2 ranks in ``tests/distributed``."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch import nn

from memfit import zoo
from memfit.measuring.twins import UncopyableModel, no_twin_reason, plain_copy
from memfit.measuring.verification import verify
from memfit.planning.plan import Plan, Region
from memfit.planning.simulate import simulate
from memfit.profiling.tracer import trace
from memfit.runtime.apply import apply_plan
from memfit.runtime.marks import applied_plan


def _uncopyable_planned_gpt(paths: tuple[str, ...]) -> tuple[nn.Module, torch.Tensor, Plan]:
    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    x = zoo.example_inputs(model, batch=2)
    prof = trace(model, x, repeats=1)
    plan = Plan(regions=tuple(Region((q,)) for q in paths), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="hand", profile_signature=prof.signature,
                plain_peak_bytes=prof.peak_bytes, plain_step_s=prof.step_time_s, model="GPT")
    sim = simulate(prof, plan)
    plan = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes, recompute_s=sim.recompute_s)
    apply_plan(model, plan)
    model.lock = threading.Lock()  # type: ignore[assignment]  # deepcopy: "cannot pickle '_thread.lock'"
    return model, x, plan


def test_plain_copy_of_an_uncopyable_model_says_why():
    model, _, _ = _uncopyable_planned_gpt(("blocks.0",))
    assert no_twin_reason(model) is None  # nothing sharded: the copy is tried, and fails
    with pytest.raises(UncopyableModel, match="cannot deep-copy GPT: TypeError: cannot pickle"):
        plain_copy(model)
    assert model.memfit_plan is not None  # the plan lifted for the copy is back


@pytest.mark.parametrize("paths", [("blocks.0",), ("blocks.0", "blocks.1")], ids=["one-block", "two-blocks"])
def test_verify_in_place_passes_bitwise_and_leaves_the_model_alone(paths):
    model, x, plan = _uncopyable_planned_gpt(paths)
    for i, p in enumerate(model.parameters()):  # grads a training loop might hold
        p.grad = torch.full_like(p, float(i)) if i % 2 else None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    torch.manual_seed(1234)
    rng = torch.get_rng_state()

    report = verify(model, x)

    assert report.compared == "in place"
    assert report.ok and report.bitwise and report.max_abs_diff == 0.0, str(report)
    assert str(report).startswith("memfit verify (hand, cpu, in place, bitwise): PASSED")
    assert 0 < report.peak_bytes < report.plain_peak_bytes
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n] is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n
    assert model.memfit_plan is plan and applied_plan(model) is plan


def test_verify_in_place_reports_a_plan_that_does_not_apply():
    model, x, plan = _uncopyable_planned_gpt(("blocks.0",))
    report = verify(model, x, plan=dataclasses.replace(plan, regions=(Region(("blocks.9",)),)))
    assert not report.ok and report.compared == "in place"
    assert [c.name for c in report.failures] == ["plan applies to the model"]
    assert "'blocks.9'" in report.failures[0].detail
    assert model.memfit_plan is plan  # the model keeps the plan it carried


@pytest.mark.parametrize(("comparison", "plain_runs"), [(None, 1), ("within plain spread", 2)],
                         ids=["bitwise", "within-plain-spread"])
def test_verify_in_place_runs_the_plain_step_twice_only_to_compare_within_its_spread(
        monkeypatch, comparison, plain_runs):
    import memfit.measuring.verification as verification

    model, x, plan = _uncopyable_planned_gpt(("blocks.0",))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    real, calls = verification.record_step, []

    def counting(step, **kw):
        calls.append(model.__dict__.get("memfit_plan"))  # None while the plan is lifted: a plain run
        return real(step, **kw)

    monkeypatch.setattr(verification, "record_step", counting)
    report = verify(model, x, comparison=comparison)
    mode = comparison or "bitwise"
    assert report.ok and report.bitwise and report.comparison == mode, str(report)
    assert str(report).startswith(f"memfit verify (hand, cpu, in place, {mode}): PASSED")
    assert calls == [None] * plain_runs + [plan]
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.memfit_plan is plan
