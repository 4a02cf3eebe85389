"""fit's plans for other input shapes (issue #28): a range planned up front, a re-plan per new
shape, and the guard's warn and raise, on the zoo GPT (NOTE [shape ranges], NOTE
[re-planning inside a training call] in memfit.job.shape_plans)."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch

import memfit
from memfit import zoo
from memfit.errors import MemfitError
from memfit.job.shape_plans import inputs_of_shape, resolve_on_new_shape
from memfit.profiling.measure import measure
from memfit.runtime.apply import input_guard
from memfit.runtime.marks import applied_plan
from memfit.runtime.shapes import OnNewShape
from memfit.step.harness import Step

BUDGET = 12 * 2**20  # 12 MiB: seq 64 fits plainly (5.9 MiB), 128 (16.4 MiB) and 256 need plans


def _peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    return measure(Step.of(model, x).run, model=model, meter="allocator").peak_bytes


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranged():
    """A 6-layer GPT fitted at seq 64 for seq 32-128 (dropout on: the RNG is part of the step)."""
    model = zoo.gpt(n_layer=6, d_model=32, n_head=2, seq_len=256, vocab_size=64)
    plain = copy.deepcopy(model)
    memfit.fit(model, zoo.example_inputs(model, batch=4, size=64), budget=BUDGET, training=memfit.Training(shapes=[(4, 32), (4, 128)], on_new_shape="replan"))
    return model, plain


@pytest.mark.slow
def test_a_range_of_shapes_is_planned_up_front_and_every_shape_in_it_fits(ranged):
    model, _ = ranged
    plan, guard = model.memfit_plan, input_guard(model)
    checked = plan.extra["shapes"]
    assert plan.budget_bytes == BUDGET and checked["one_plan"] is True
    # profiled: the fit's seq 64, the two given and their midpoint (80)
    assert sorted(checked["predicted_peak_bytes"]) == sorted(
        f"(0=4x{t}:int64, parameters:float32)" for t in (32, 64, 80, 128))
    peaks = {}
    for t in (32, 64, 96, 128):  # 96 was not profiled: the range covers it
        x = zoo.example_inputs(model, batch=4, size=t, seed=t)
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        peaks[t] = _peak(model, x)
    print("measured peaks", peaks, "budget", BUDGET)
    assert all(p <= BUDGET for p in peaks.values()), peaks
    assert all(p <= BUDGET for p in checked["predicted_peak_bytes"].values())
    assert plan.regions and plan.input_signature[0] == ("0", (4, 128), "int64")  # the largest
    assert guard is not None and guard.replans == 0


@pytest.mark.slow
def test_a_new_shape_is_re_planned_once_for_the_same_bytes_with_bitwise_gradients(ranged):
    model, plain = ranged
    guard = input_guard(model)
    assert guard is not None
    x = zoo.example_inputs(model, batch=4, size=256, seed=1)
    for twin in (model, plain):
        twin.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        twin(x).sum().backward()
        if twin is model:
            rng = torch.get_rng_state()
    assert guard.replans == 1
    assert torch.equal(rng, torch.get_rng_state())
    planned, reference = _grads(model), _grads(plain)
    assert all(torch.equal(planned[n], reference[n]) for n in reference)
    replanned = model.memfit_plan
    assert replanned.input_signature[0] == ("0", (4, 256), "int64")
    assert replanned.budget_bytes == BUDGET and replanned.regions
    model.zero_grad(set_to_none=True)
    peak = _peak(model, x)
    print("seq 256 re-planned: measured peak", peak, "predicted", replanned.predicted_peak_bytes,
          "budget", BUDGET)
    assert peak <= BUDGET
    for t in (256, 64, 256):  # held: switched between the plans, not re-planned
        model(zoo.example_inputs(model, batch=4, size=t)).sum().backward()
    assert guard.replans == 1
    assert model.memfit_plan is replanned


@pytest.fixture(scope="module")
def small():
    """A 3-layer GPT fitted at seq 64 for 95% of its plain peak, on_new_shape left default."""
    model = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=128, vocab_size=64)
    memfit.fit(model, zoo.example_inputs(model, batch=4, size=64), budget=0.95)
    return model, model.memfit_plan


@pytest.mark.slow
def test_the_default_re_plans_for_the_budget_in_bytes_not_as_a_fraction(small):
    model, first = small
    x = zoo.example_inputs(model, batch=4, size=96)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    again = model.memfit_plan
    guard = input_guard(model)
    assert guard is not None and guard.on_new is OnNewShape.REPLAN and guard.replans == 1
    assert again.input_signature[0] == ("0", (4, 96), "int64")
    # 95% of seq 96's plain peak would be 1.8x the bytes seq 64's budget is
    assert again.budget_bytes == first.budget_bytes < 0.95 * again.plain_peak_bytes
    assert _peak(model, x) <= first.budget_bytes


@pytest.mark.slow
def test_warn_warns_once_per_new_shape_and_raise_names_it(small):
    model, plan = small
    memfit.apply(model, plan, on_new_shape="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (64, 112, 112, 120, 112):
            model(zoo.example_inputs(model, batch=4, size=t)).sum().backward()
        with torch.no_grad():
            model(zoo.example_inputs(model, batch=4, size=100))
    messages = [str(w.message) for w in caught if "memfit" in str(w.message)]
    assert len(messages) == 2, messages
    assert "4x112:int64" in messages[0] and "4x120:int64" in messages[1]
    assert all("on_new_shape='replan'" in m for m in messages)
    memfit.apply(model, plan, on_new_shape="raise")
    model(zoo.example_inputs(model, batch=4, size=64)).sum().backward()
    with pytest.raises(memfit.NewInputShape, match=r"4x128:int64.*shapes=\[\.\.\.\]") as err:
        model(zoo.example_inputs(model, batch=4, size=128))
    assert err.value.got[0] == ("0", torch.Size([4, 128]), torch.int64)
    assert input_guard(model).replans == 0


def test_fit_passes_raise_to_the_planned_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                  for _ in range(3)))
    memfit.fit(model, torch.randn(64, 32), budget="min", training=memfit.Training(on_new_shape="raise"))
    model(torch.randn(64, 32)).sum().backward()
    with pytest.raises(memfit.NewInputShape, match="128x32:float32"):
        model(torch.randn(128, 32))


@pytest.mark.parametrize("given, callable_step, distributed, expected", [
    (None, False, False, OnNewShape.REPLAN),
    (None, True, False, OnNewShape.WARN),
    (None, False, True, OnNewShape.WARN),
    ("raise", True, True, OnNewShape.RAISE),
    ("warn", False, False, OnNewShape.WARN),
], ids=["default", "default-step", "default-distributed", "raise", "warn"])
def test_on_new_shape_default_and_choices(given, callable_step, distributed, expected):
    assert resolve_on_new_shape(given, callable_step=callable_step,
                                distributed=distributed) is expected


@pytest.mark.parametrize("callable_step, distributed, match", [
    (True, False, "step given as a callable"),
    (False, True, "distributed"),
], ids=["step", "distributed"])
def test_replan_is_refused_where_it_cannot_run(callable_step, distributed, match):
    with pytest.raises(ValueError, match=match):
        resolve_on_new_shape("replan", callable_step=callable_step, distributed=distributed)
    with pytest.raises(ValueError, match="'replan', 'warn' or 'raise'"):
        resolve_on_new_shape("always", callable_step=False, distributed=False)


def test_inputs_of_a_shape_are_sliced_or_tiled_from_the_example():
    x = torch.arange(8).view(2, 4)
    assert torch.equal(inputs_of_shape(x, (1, 6)), torch.tensor([[0, 1, 2, 3, 0, 1]]))
    assert torch.equal(inputs_of_shape(x, [2, 2]), x[:, :2])
    given = {"input_ids": x}
    assert inputs_of_shape(x, given) is given
    with pytest.raises(TypeError, match="one tensor"):
        inputs_of_shape({"input_ids": x}, (2, 4))
    with pytest.raises(TypeError, match="3 dimensions"):
        inputs_of_shape(x, (2, 4, 1))


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                  torch.nn.ReLU()) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), *blocks,
                               torch.nn.Flatten(), torch.nn.LazyLinear(10))


@pytest.mark.slow
def test_a_re_plan_inside_a_call_leaves_grads_buffers_and_rng_as_the_plain_step_s():
    """NOTE [re-planning inside a training call]: the re-plan's profile runs forward and
    backward inside the call; gradients accumulated before it, BatchNorm statistics and the
    RNG come out as without it."""
    model = _bn_net()
    model(torch.randn(2, 3, 8, 8))  # the lazy layer takes its shape
    plain = copy.deepcopy(model)
    memfit.fit(model, torch.randn(4, 3, 8, 8), budget="min")
    torch.manual_seed(1)
    xs = [torch.randn(4, 3, 8, 8), torch.randn(6, 3, 8, 8)]  # the second is re-planned
    rng = []
    for twin in (model, plain):
        twin.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        for x in xs:  # gradients accumulate over both calls
            twin(x).sum().backward()
        rng.append(torch.get_rng_state())
    assert input_guard(model).replans == 1
    assert torch.equal(rng[0], rng[1])
    planned, reference = _grads(model), _grads(plain)
    assert all(torch.equal(planned[n], reference[n]) for n in reference)
    buffers = dict(plain.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def _fake_profile(t: int, peak: int):
    from types import SimpleNamespace

    return SimpleNamespace(input_signature=(("0", (4, t), "int64"),), peak_bytes=peak, model="GPT")


@pytest.mark.parametrize("at_32, at_80, at_128, one_plan, ranges", [
    # the plan of the largest plain peak (seq 80) simulated at each shape; then, where it does
    # not fit everywhere, seq 128's own plan simulated at seq 80 (90 here: over the budget)
    (50, 90, 100, True, [(32, 128, "P80")]),
    (50, 90, 120, False, [(32, 80, "P80")]),
], ids=["one-plan", "a-plan-per-shape"])
def test_a_range_gets_one_plan_where_it_fits_everywhere_else_a_plan_per_shape(
        monkeypatch, at_32, at_80, at_128, one_plan, ranges):
    """NOTE [shape ranges] on hand-made numbers (budget 100): activation memory not monotone
    in the sequence (seq 80 peaks highest)."""
    import memfit.planning.simulate as simulate_module
    from memfit.job.shape_plans import plan_range
    from memfit.runtime.shapes import signature_of

    profiles = {t: _fake_profile(t, peak) for t, peak in ((32, 150), (80, 300), (128, 200))}
    plans = {t: f"P{t}" for t in profiles}
    peaks = {(32, "P80"): at_32, (80, "P80"): at_80, (128, "P80"): at_128, (80, "P128"): 120,
             (128, "P128"): 95}

    def simulate(profile, plan):
        from types import SimpleNamespace

        return SimpleNamespace(peak_bytes=peaks[(profile.input_signature[0][1][1], plan)])

    monkeypatch.setattr(simulate_module, "simulate", simulate)
    top, by_signature, got, checked = plan_range(
        list(profiles.values()), lambda p: plans[p.input_signature[0][1][1]], 100)
    assert top == "P80" and checked["one_plan"] is one_plan
    assert [(r.low[0][1][1], r.high[0][1][1], r.plan) for r in got] == ranges
    assert by_signature[signature_of(profiles[128].input_signature)] == ("P80" if one_plan
                                                                          else "P128")


def test_a_shape_no_plan_fits_is_named():
    from memfit.errors import InfeasibleBudget
    from memfit.job.shape_plans import plan_range

    def infeasible(p):
        raise InfeasibleBudget("budget too small", budget_bytes=100, min_feasible_bytes=120)

    with pytest.raises(InfeasibleBudget, match=r"Training\(shapes=...\): no plan fits inputs "
                       r"\(0=4x128:int64\).*budget too small") as err:
        plan_range([_fake_profile(64, 150), _fake_profile(128, 200)], infeasible, 100)
    assert err.value.min_feasible_bytes == 120


def _saved_and_loaded(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _mean_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


COPIES = {"torch.save": _saved_and_loaded, "deepcopy": copy.deepcopy, "copy": copy.copy}


@pytest.fixture(scope="module")
def pickled():
    """Issue #39's fitted GPT (on_new_shape="replan", the default) and its plain twin."""
    torch.manual_seed(0)
    model = zoo.gpt(n_layer=2, d_model=64, n_head=4, seq_len=64, vocab_size=256)
    plain = copy.deepcopy(model)
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    memfit.fit(model, x, budget=0.7, loss_fn=_mean_loss)
    return model, plain, x


def _step(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    _mean_loss(model(x)).backward()
    return _grads(model)


@pytest.mark.parametrize("how", COPIES)
def test_a_fitted_model_pickles_and_copies_and_trains_like_plain(pickled, how):
    """NOTE [a fitted model pickles]: torch.save raised "Can't pickle local object
    'replanner.<locals>.replan'" before (issue #39). The copy runs its plan (its measured peak
    is the original's, to the byte) with gradients bitwise the plain twin's, and re-plans a
    new shape itself, bitwise too."""
    model, plain, x = pickled
    copied = COPIES[how](model)
    plan = model.memfit_plan
    assert applied_plan(copied) == plan and plan.regions
    assert _peak(copied, x) == _peak(model, x) <= plan.budget_bytes
    got, want = _step(copied, x), _step(plain, x)
    assert all(torch.equal(got[n], want[n]) for n in want)
    guard = input_guard(copied)
    assert guard is not None
    replans = guard.replans
    short = x[:, :32].contiguous()
    got, want = _step(copied, short), _step(plain, short)
    assert guard.replans == replans + 1
    assert all(torch.equal(got[n], want[n]) for n in want)
    if how != "copy":  # a shallow copy shares the guard; the others re-plan on their own
        assert input_guard(model).replans == 0


def test_a_loss_fn_pickle_cannot_save_is_left_out_and_named_at_the_re_plan(caplog):
    torch.manual_seed(0)
    model = zoo.gpt(n_layer=1, d_model=32, n_head=2, seq_len=64, vocab_size=64)
    plain = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    memfit.fit(model, x, budget="min", loss_fn=lambda out: out.float().mean())
    with caplog.at_level(logging.WARNING, logger="memfit.job.shape_plans"):
        loaded = _saved_and_loaded(model)
    assert "cannot be pickled" in caplog.text
    got, want = _step(loaded, x), _step(plain, x)  # the loss_fn is the test's own here
    assert all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(MemfitError, match=r"loaded from a pickle without its loss_fn \(<function"):
        loaded(x[:, :32]).sum().backward()
    copied = copy.deepcopy(model)  # a deep copy keeps the lambda, and re-plans
    _mean_loss(copied(x[:, :32])).backward()
    assert input_guard(copied).replans == 1
