"""``largest_batch`` (NOTE [largest batch search]): the answer fits three real steps, one more
fits no plan, and the search profiles few sizes."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import InfeasibleBudget, zoo
from memfit.profiling.meters import AllocatorMeter
from memfit.profiling.tracer import profile as trace


def _gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=2, d_model=64, n_head=2, seq_len=64, dropout=0.0)


def test_the_largest_batch_fits_three_real_steps_and_one_more_fits_no_plan():
    model = _gpt()
    make = lambda n: (model, torch.randint(0, 512, (n, 64), generator=torch.Generator().manual_seed(n)))  # noqa: E731
    one = trace(model, make(1)[1], repeats=1)
    weights = sum(p.nbytes for p in one.parameters) + one.buffer_bytes
    device = 4 * weights + 6 * one.peak_bytes
    found = memfit.largest_batch(make, device_memory=device, optimizer="adamw")
    n = found.batch
    assert n > 2 and found.plan.memory is not None and found.plan.memory.fits
    assert len(found.probes) < n  # few profiles, not one per candidate
    above = next(p for p in found.probes if p.n == n + 1)
    assert not above.fits and above.smallest_total_bytes > device
    with pytest.raises(InfeasibleBudget):  # the planner says so on a fresh profile too
        memfit.plan(memfit.profile(model, make(n + 1)[1]), device_memory=device, optimizer="adamw")

    x = make(n)[1]
    memfit.apply(model, found.plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with AllocatorMeter() as m:
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                out = model(x)
                out.sum().backward()
                del out
                opt.step()
    finally:
        memfit.unapply(model)
    measured = weights + m.peak_bytes
    assert measured <= device
    torch.testing.assert_close(measured, found.plan.memory.total_bytes, rtol=0.03, atol=0)


def test_max_overhead_bounds_the_predicted_recompute():
    model = _gpt()
    make = lambda n: (model, torch.randint(0, 512, (n, 64)))  # noqa: E731
    one = trace(model, make(1)[1], repeats=1)
    device = 4 * sum(p.nbytes for p in one.parameters) + 6 * one.peak_bytes
    free = memfit.largest_batch(make, device_memory=device, optimizer="adamw", limit=64)
    capped = memfit.largest_batch(make, device_memory=device, optimizer="adamw", max_overhead=0.0,
                                  limit=64)
    assert capped.overhead == 0.0 and not capped.plan.regions
    assert capped.batch <= free.batch


def test_not_even_one_fits_says_so():
    model = _gpt()
    with pytest.raises(InfeasibleBudget, match="not even a batch of 1 fits") as e:
        memfit.largest_batch(lambda n: (model, torch.randint(0, 512, (n, 64))),
                             device_memory=1000, optimizer="adamw")
    assert e.value.memory is not None and not e.value.memory.fits


def test_bad_arguments_are_refused():
    model = _gpt()
    with pytest.raises(ValueError, match="max_overhead"):
        memfit.largest_batch(lambda n: (model, None), device_memory="1GiB", max_overhead=-1)
    with pytest.raises(TypeError, match=r"make\(1\) must return \(model, example_inputs\)"):
        memfit.largest_batch(lambda n: model, device_memory="1GiB")
