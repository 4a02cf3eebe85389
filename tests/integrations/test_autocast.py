"""fit inside ``torch.autocast``: profile, prediction and the planned step run the same ops
(NOTE [a fresh autocast cache per run])."""

from __future__ import annotations

import logging

import pytest
import torch

import memfit
from memfit import zoo
from memfit.step import Step


def _gpt():
    # dropout on: the planned step must replay the RNG under autocast too
    return zoo.gpt(n_layer=4, d_model=64, n_head=2, seq_len=64, vocab_size=128, dropout=0.1)


@pytest.fixture()
def bf16():
    with torch.autocast("cpu", torch.bfloat16):
        yield


def test_profile_in_autocast_times_the_traced_ops(bf16, caplog):
    model = _gpt()
    x = zoo.example_inputs(model, batch=4)
    with caplog.at_level(logging.WARNING, logger="memfit.profiling.tracer"):
        prof = memfit.profile(model, x, repeats=3)
    assert not [r for r in caplog.records if "timing run dispatched" in r.getMessage()]
    assert prof.extra["repeats"] == 3
    # every run casts the weights: a measured step peaks where the profile says (the two meters
    # differ by a few bytes of allocator rounding, 32 measured here)
    measured = memfit.measure(Step.of(model, x).run, model=model).peak_bytes
    assert abs(measured - prof.peak_bytes) <= 0.001 * prof.peak_bytes, (measured, prof.peak_bytes)


def _hf_gpt2():
    from hf_models import batch, gpt2

    return gpt2, lambda m: batch()


MODELS = {
    "zoo-gpt": lambda: (_gpt, lambda m: zoo.example_inputs(m, batch=4)),
    "hf-gpt2": _hf_gpt2,  # default config: use_cache on, dropout 0.1
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fit_in_autocast_meets_its_budget_bitwise(bf16, name):
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
    build, make_inputs = MODELS[name]()
    model, twin = build(), build()
    x = make_inputs(model)
    plain_bytes = memfit.measure(Step.of(twin, x).run, model=twin).peak_bytes
    budget = int(0.55 * plain_bytes)
    memfit.fit(model, x, budget=budget)
    plan = model.memfit_plan
    assert plan.regions and plan.predicted_peak_bytes <= budget
    got = memfit.measure(Step.of(model, x).run, model=model).peak_bytes
    assert got <= 1.03 * budget, (got, budget)
    # 0.9% off measured; 4.8% (too low) when a timing run reused the cast weights of the run
    # before, so 2% tells the two apart
    assert abs(got - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes, (
        got, plan.predicted_peak_bytes)
    for m in (model, twin):
        torch.manual_seed(0)
        Step.of(m, x).run()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), name
