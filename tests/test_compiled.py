"""``memfit.compile`` (NOTE [budgets measured under compilation] in memfit.compiled): the
budget search on measured compiled peaks, and the compiled model it returns."""

from __future__ import annotations

import functools

import pytest
import torch

import memfit
from memfit.compiled import CompiledRound, _next_budget
from memfit.zoo import gpt

CAP = 1000


def _r(planned_for: int, measured: int) -> CompiledRound:
    return CompiledRound(planned_for, planned_for, measured, 0.0, measured <= CAP)


@pytest.mark.parametrize("rounds, want", [
    ([_r(1000, 800)], 1200),                     # 200 B of slack: plan for 200 B more
    ([_r(1000, 990)], None),                     # within 2% below the budget: done
    ([_r(1000, 800), _r(1200, 1100)], 1100),     # over: bisect 1000..1200
    ([_r(1000, 800), _r(1200, 1100), _r(1100, 1005)], 1050),
    ([_r(1000, 800), _r(1200, 1100), _r(1100, 950), _r(1115, 1010)], None),  # 1100..1115: < 2%
    ([_r(1000, 1100)], 900),                     # over at first: lower by the excess
    ([_r(1000, 1100), _r(900, 1050)], 850),      # still over: lower again
], ids=["slack", "close", "bisect", "bisect-again", "converged", "over", "over-again"])
def test_next_budget(rounds: list[CompiledRound], want: int | None) -> None:
    assert _next_budget(rounds, CAP, 0.02) == want


V, B, T = 64, 8, 64


def _model() -> torch.nn.Module:
    return gpt(n_layer=2, d_model=32, n_head=2, seq_len=T, vocab_size=V, dropout=0.0, seed=0)


def _batch() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


AOT_EAGER = functools.partial(torch.compile, backend="aot_eager")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_compile_measures_the_compiled_step_within_the_budget_and_trains_bitwise() -> None:
    model = _model()
    compiled = memfit.compile(model, _batch(), budget=0.7, compiler=AOT_EAGER)
    rounds = model.memfit_compiled
    assert rounds and all(isinstance(r, CompiledRound) for r in rounds)
    cap = rounds[0].planned_for_bytes
    chosen = max((r for r in rounds if r.within), key=lambda r: r.planned_for_bytes)
    assert model.memfit_plan.budget_bytes == chosen.planned_for_bytes
    assert all(r.within == (r.measured_peak_bytes <= cap) for r in rounds)
    assert any(n.startswith("costs as torch.compile") for n in model.memfit_plan.notes)
    # one step of the returned model against the compiled plain model (aot_eager: bitwise)
    plain = torch.compile(_model(), backend="aot_eager")
    for m in (compiled, plain):
        torch.manual_seed(0)
        m(_batch()).float().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_compile_min_measures_once() -> None:
    model = _model()
    memfit.compile(model, _batch(), budget="min", compiler=AOT_EAGER)
    assert len(model.memfit_compiled) == 1


@pytest.mark.parametrize("kwargs, error, words", [
    ({"search": memfit.Search()}, ValueError, "plans with compiled costs"),
    ({"rounds": -1}, ValueError, "rounds must be an int >= 0"),
    ({"tolerance": 1.0}, ValueError, "tolerance must be in"),
], ids=["eager-search", "rounds", "tolerance"])
def test_compile_refuses_bad_arguments(kwargs, error, words) -> None:
    with pytest.raises(error, match=words):
        memfit.compile(_model(), _batch(), budget=0.7, compiler=AOT_EAGER, **kwargs)


class _Bloated(torch.nn.Module):
    """A "compiler" whose step holds 8 MiB more than the plan: no round can fit."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(2 << 20, requires_grad=True)  # 8 MiB, saved by the mul for backward
        return self.inner(x) * big[:1].sum() * big.sum()


@pytest.mark.parametrize("before", ["none", "a plan"])
def test_compile_with_no_round_in_budget_leaves_the_model_as_it_was(before) -> None:
    model = _model()
    x = _batch()
    old = memfit.plan(memfit.profile(model, x), budget=0.9) if before == "a plan" else None
    if old is not None:
        memfit.apply(model, old)
    with pytest.raises(memfit.InfeasibleBudget, match="left as it was") as err:
        memfit.compile(model, x, budget=0.7, compiler=_Bloated, rounds=1)
    assert err.value.min_feasible_bytes > err.value.budget_bytes
    assert model.__dict__.get("memfit_plan") is old
