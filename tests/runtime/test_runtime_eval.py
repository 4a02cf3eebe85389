"""Plans apply whenever autograd records, in train() and eval() (NOTE [when a region
checkpoints]); under no_grad / inference_mode the planned modules run plainly."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import CallCounter, TinyGPT, assert_bitwise_twin, conv_net

import memfit
from memfit import zoo
from memfit.measuring.verification import make_step
from memfit.planning.plan import Plan, Region
from memfit.runtime import checkpoint as _checkpoint
from memfit.runtime.apply import apply_plan

PEAK_RTOL = 0.03  # verify's tolerance on the budget


def _plan(*regions: Region) -> Plan:
    return Plan(regions=regions, predicted_peak_bytes=0, recompute_s=0.0, budget_bytes=None,
                solver="test", profile_signature="")


def _eval_gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=4, d_model=32, n_head=2, seq_len=32, vocab_size=64).eval()


@pytest.mark.slow
def test_eval_mode_gpt_fitted_at_half_verifies_and_fits_its_budget():
    model = _eval_gpt()
    twin = copy.deepcopy(model)
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    plain = memfit.measure(make_step(twin, x), model=twin)
    memfit.fit(model, x, budget=0.5)
    plan = model.memfit_plan
    assert plan.regions and not model.training

    report = memfit.verify(model, x)
    assert report.ok and report.bitwise, str(report)

    torch.manual_seed(0)
    model(x).sum().backward()
    torch.manual_seed(0)
    twin(x).sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n
    model.zero_grad(set_to_none=True)

    planned = memfit.measure(make_step(model, x), model=model)
    assert planned.peak_bytes < plain.peak_bytes
    assert planned.peak_bytes <= plan.budget_bytes * (1 + PEAK_RTOL), (planned, plan)


PLANS = {
    "wrap": (_plan(Region(("0",)), Region(("1",))), 2),
    "segment": (_plan(Region(("0", "1", "2"))), 3),
}


@pytest.mark.parametrize("plan,regions", PLANS.values(), ids=PLANS.keys())
def test_frozen_batchnorm_in_eval_is_recomputed_bitwise(plan, regions):
    torch.manual_seed(0)
    model = conv_net().eval()  # frozen-BatchNorm fine-tuning
    twin = copy.deepcopy(model)
    apply_plan(model, plan)
    counter = CallCounter(model[0].conv, model[1].conv, model[2].conv)
    assert_bitwise_twin(model, twin, (torch.randn(4, 3, 12, 12).requires_grad_(),), steps=2)
    # per step: 3 forwards plus one recomputation per checkpointed block
    assert counter.count == 2 * (3 + regions)
    assert int(model[0].bn.num_batches_tracked) == 0


class _Counting(_checkpoint.RegionContexts):
    made = 0

    def __init__(self, *args, **kwargs) -> None:
        type(self).made += 1
        super().__init__(*args, **kwargs)


GRAD_OFF = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("grad_off", GRAD_OFF.values(), ids=GRAD_OFF.keys())
def test_eval_forward_without_autograd_makes_no_checkpoint_state(monkeypatch, grad_off):
    monkeypatch.setattr(_checkpoint, "RegionContexts", _Counting)
    monkeypatch.setattr(_Counting, "made", 0)
    torch.manual_seed(0)
    model = TinyGPT().eval()
    twin = copy.deepcopy(model)
    apply_plan(model, _plan(Region(("blocks.0",)), Region(("blocks.1", "blocks.2"))))
    ids = torch.randint(0, 64, (2, 8))
    with grad_off():
        torch.manual_seed(1)
        out = model(ids)
        torch.manual_seed(1)
        ref = twin(ids)
    assert torch.equal(out, ref)
    assert _Counting.made == 0
    with grad_off():
        peak = memfit.measure(lambda: model(ids), meter="dispatch").peak_bytes
        plain = memfit.measure(lambda: twin(ids), meter="dispatch").peak_bytes
    assert peak == plain
    model(ids).sum().backward()  # autograd records: both regions checkpoint, also in eval()
    assert _Counting.made == 2
