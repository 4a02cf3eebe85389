"""fit inside ``torch.autocast``: profile, prediction and the planned step run the same ops
(NOTE [a fresh autocast cache per run])."""

from __future__ import annotations

import logging

import pytest
import torch

import memfit
from memfit import zoo
from memfit.step.harness import Step


def _gpt():
    # dropout on: the planned step must replay the RNG under autocast too
    return zoo.gpt(n_layer=4, d_model=64, n_head=2, seq_len=64, vocab_size=128, dropout=0.1)


@pytest.fixture()
def bf16():
    with torch.autocast("cpu", torch.bfloat16):
        yield


@pytest.mark.slow
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


@pytest.mark.slow
def test_profile_marks_the_casts_autocast_caches(bf16):
    """Autocast caches the copies of float32 leaves that require grad: the weight's, the
    bias's, and this input's; not the input's without ``requires_grad``. The bias's, which
    nothing saves, is held by the cache to the end of the forward, where ``Step.run`` clears
    it (NOTE [autocast-cached storages])."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh())
    x = torch.randn(2, 8, requires_grad=True)  # so that the weight's copy is saved
    prof = memfit.profile(model, x, repeats=1)
    cached = {s.nbytes: s for s in prof.storages if s.autocast_cached}
    assert sorted(cached) == [8, 32, 64]  # bias 4, input 2 x 8, weight 4 x 8, in bf16
    assert all(prof.ops[s.created_by].name == "aten._to_copy.default" for s in cached.values())
    assert cached[64].saved and not cached[8].saved
    assert cached[8].freed_after == prof.n_forward - 1
    plain_x = memfit.profile(model, x.detach(), repeats=1)
    assert sorted(s.nbytes for s in plain_x.storages if s.autocast_cached) == [8, 64]
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        off = memfit.profile(model, x, repeats=1)
    assert not [s for s in off.storages if s.autocast_cached]


@pytest.mark.parametrize("blocks", [(2,), (0, 1, 2), (0, 1, 2, 3)])
@pytest.mark.slow
def test_checkpointed_blocks_in_autocast_peak_as_predicted(bf16, blocks):
    """Regions run without autocast's cache (NOTE [autocast's cast cache]): predicted to a few
    hundred bytes of allocator rounding (-96 B to +120 B measured). Before, with the cache
    holding the weights' copies through backward in the profile, every block was predicted
    20.8% (411 KB) over; then 6.2 KB over with the biases' copies and the replay's last
    dropout counted."""
    import dataclasses

    from memfit.planning.plan import Region
    from memfit.planning.planner import plan_for_budget
    from memfit.planning.simulate import simulate
    from memfit.runtime.apply import apply_plan, unapply

    model = _gpt()
    x = zoo.example_inputs(model, batch=4)
    prof = memfit.profile(model, x, repeats=1)
    plan = dataclasses.replace(plan_for_budget(prof, budget=1.0, solver="every_block"),
                               regions=tuple(Region((f"blocks.{i}",)) for i in blocks))
    predicted = simulate(prof, plan).peak_bytes
    apply_plan(model, plan, check=False)
    try:
        got = memfit.measure(Step.of(model, x).run, model=model).peak_bytes
    finally:
        unapply(model)
    assert abs(got - predicted) <= 256, (got, predicted)


def _hf_gpt2():
    from hf_models import batch, gpt2

    return gpt2, lambda m: batch()


MODELS = {
    "zoo-gpt": lambda: (_gpt, lambda m: zoo.example_inputs(m, batch=4)),
    "hf-gpt2": _hf_gpt2,  # default config: use_cache on, dropout 0.1
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
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
    # -120 to +144 B off measured at budgets of 45-70% (allocator rounding); 2.2% over when the
    # cache held the cast weights through backward (NOTE [autocast's cast cache]), 4.8% under
    # when a timing run reused the cast weights of the run before
    assert abs(got - plan.predicted_peak_bytes) <= 512, (got, plan.predicted_peak_bytes)
    for m in (model, twin):
        torch.manual_seed(0)
        Step.of(m, x).run()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), name
