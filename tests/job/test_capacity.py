"""``largest_batch`` (NOTE [largest batch search]): the answer fits three real steps, one more
fits no plan, and the search profiles few sizes; a card this host lacks is searched on fake
tensors (NOTE [largest batch on fake tensors])."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import memfit
from memfit import InfeasibleBudget, zoo
from memfit.profiling.meters import AllocatorMeter
from memfit.profiling.tracer import ProfileMode, trace


def _gpt() -> torch.nn.Module:
    return zoo.gpt(n_layer=2, d_model=64, n_head=2, seq_len=64, dropout=0.0)


def test_the_largest_batch_fits_three_real_steps_and_one_more_fits_no_plan():
    model = _gpt()
    make = lambda n: (model, torch.randint(0, 512, (n, 64), generator=torch.Generator().manual_seed(n)))  # noqa: E731
    one = trace(model, make(1)[1], repeats=1)
    weights = sum(p.nbytes for p in one.parameters) + one.buffer_bytes
    device = 4 * weights + 6 * one.peak_bytes
    found = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"))
    n = found.batch
    assert n > 2 and found.plan.memory is not None and found.plan.memory.fits
    assert len(found.probes) < n  # few profiles, not one per candidate
    above = next(p for p in found.probes if p.n == n + 1)
    assert not above.fits and above.smallest_total_bytes > device
    with pytest.raises(InfeasibleBudget):  # the planner says so on a fresh profile too
        memfit.plan(memfit.profile(model, make(n + 1)[1]), memfit.Job(device=device, optimizer="adamw"))

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
    free = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"), limit=64)
    capped = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"), max_overhead=0.0,
                                  limit=64)
    assert capped.overhead == 0.0 and not capped.plan.regions
    assert capped.batch <= free.batch


def test_not_even_one_fits_says_so():
    model = _gpt()
    with pytest.raises(InfeasibleBudget, match="not even a batch of 1 fits") as e:
        memfit.largest_batch(lambda n: (model, torch.randint(0, 512, (n, 64))),
                             memfit.Job(device=1000, optimizer="adamw"))
    assert e.value.memory is not None and not e.value.memory.fits


def test_bad_arguments_are_refused():
    model = _gpt()
    with pytest.raises(ValueError, match="max_overhead"):
        memfit.largest_batch(lambda n: (model, None), memfit.Job(device="1GiB"), max_overhead=-1)
    with pytest.raises(TypeError, match=r"make\(1\) must return \(model, example_inputs\)"):
        memfit.largest_batch(lambda n: model, memfit.Job(device="1GiB"))


class _Positions(torch.nn.Module):
    """A user's model with learned positions: it refuses sequences longer than 24 itself."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(64, 16)
        self.pos = torch.nn.Parameter(torch.zeros(24, 16))
        self.out = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.pos.shape[0]:
            raise ValueError(f"{ids.shape[1]} tokens, at most {self.pos.shape[0]} positions")
        return self.out(self.tok(ids) + self.pos[: ids.shape[1]])     # (batch, time, vocab)


@pytest.mark.parametrize("model, limit, message", [
    (zoo.gpt(n_layer=1, d_model=32, n_head=2, seq_len=64, vocab_size=64), 64,
     "ValueError: sequence of 65 tokens is longer than the model's seq_len 64"),
    (_Positions(), 24, "_Positions's forward raised ValueError: 25 tokens, at most 24 positions"),
], ids=["zoo-gpt", "user-model"])
def test_a_sequence_search_stops_at_the_model_s_own_limit(model, limit, message):
    """The model's ValueError at its maximum length escaped the search before (issue #39)."""
    found = memfit.largest_batch(lambda n: (model, torch.randint(0, 64, (2, n))),
                                 memfit.Job(device="1GiB"))
    assert found.batch == limit
    assert found.model_limit is not None and found.model_limit.startswith(message)
    assert f"the model's own limit bounded the search: at {limit + 1} it raised {message}" in str(found)
    refused = [p.n for p in found.probes if p.error is not None]
    assert min(refused) == limit + 1 and all(not p.fits for p in found.probes if p.error)


@pytest.mark.slow
def test_fake_and_real_searches_agree_where_both_run():
    model = _gpt()
    make = lambda n: (model, torch.randint(0, 512, (n, 64)))  # noqa: E731
    one = trace(model, make(1)[1], repeats=1)
    device = 4 * sum(p.nbytes for p in one.parameters) + 6 * one.peak_bytes
    real = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"), mode="measure")
    fake = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"), mode="fake")
    assert {p.mode for p in real.probes} == {ProfileMode.MEASURE} == {real.mode}
    assert {p.mode for p in fake.probes} == {ProfileMode.FAKE} == {fake.mode}
    assert fake.batch == real.batch > 2
    # the smallest plan's whole job at every size, to the byte: no CPU kernel workspace of this
    # GPT sits at its smallest plan's peak (NOTE [largest batch on fake tensors])
    assert [(p.n, p.fits, p.smallest_total_bytes) for p in fake.probes] == [
        (p.n, p.fits, p.smallest_total_bytes) for p in real.probes]
    # by default the sizes whose plain step is larger than the device run on fake tensors
    auto = memfit.largest_batch(make, memfit.Job(device=device, optimizer="adamw"))
    assert auto.batch == real.batch and auto.mode is ProfileMode.FAKE
    for p in auto.probes:
        plain = trace(model, make(p.n)[1], mode="fake", repeats=1).peak_bytes
        assert p.mode is (ProfileMode.MEASURE if plain <= device else ProfileMode.FAKE), p
    assert "its plan made on fake tensors" in str(auto)
    with pytest.raises(ValueError, match="mode must be 'measure', 'fake' or None"):
        memfit.largest_batch(make, memfit.Job(device=device), mode="meta")


@pytest.mark.processes
def test_the_readme_search_for_an_80_gib_card_runs_on_fake_tensors():
    # the README's example: real steps near 80 GiB were killed by the OOM killer at 20.2 GB
    code = textwrap.dedent("""
        import json, resource, torch, memfit
        model = memfit.zoo.gpt(n_layer=4, d_model=128, n_head=4, seq_len=128)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        found = memfit.largest_batch(lambda n: (model, torch.randint(0, 512, (n, 128))),
                                     memfit.Job(device="80GiB", optimizer="adamw"))
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({"batch": found.batch, "mode": found.mode.value, "grown_kib": grown_kib,
                          "total": found.plan.memory.total_bytes, "text": str(found),
                          "probes": [(p.n, p.mode.value) for p in found.probes]}))
    """)
    src = Path(memfit.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["batch"] > 10_000 and got["mode"] == "fake"
    assert got["total"] <= 80 * 2**30
    # the answer's plain step is hundreds of GB; the search grew the process by 297 MB
    # (the example inputs make(n) builds, the planner's arrays): under 1 GiB
    assert got["grown_kib"] < 1024 * 1024, got["grown_kib"]
    assert all(mode == "fake" for n, mode in got["probes"] if n > 2), got["probes"]
    assert "on fake tensors" in got["text"]


@pytest.mark.slow
def test_a_fitted_model_is_searched_on_fake_tensors_as_a_fresh_one():
    """The README fits a model, then asks for its largest batch on an 80 GiB card: the plan is
    lifted while the sizes are traced (a planned model does not trace on fake tensors, and a
    real step at each size ran the host out of memory), and put back afterwards."""
    fitted = zoo.gpt(n_layer=4, d_model=128, n_head=4, seq_len=128)
    fresh = copy.deepcopy(fitted)
    memfit.fit(fitted, zoo.example_inputs(fitted, batch=4),
               job=memfit.Job(device="32MiB", optimizer="adamw"))
    plan = fitted.memfit_plan
    job = memfit.Job(device="80GiB", optimizer="adamw")
    got = memfit.largest_batch(lambda n: (fitted, torch.randint(0, 512, (n, 128))), job)
    want = memfit.largest_batch(lambda n: (fresh, torch.randint(0, 512, (n, 128))), job)
    assert got.batch == want.batch and got.batch > 10_000
    assert got.mode is ProfileMode.FAKE
    assert got.plan.regions == want.plan.regions
    assert fitted.memfit_plan == plan  # the model's own plan is back
