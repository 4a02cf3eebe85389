"""Measured plan selection (``memfit.measuring.tuning``): candidates, interleaved timing, the record.

Timing tests use hand-made candidates on a model whose modules advance an injected clock (or
sleep) on every forward call, so a plan that recomputes a "slow" module is slower by a known
amount on every step: the choice cannot come out right by luck, and nothing asserts real speed.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.measuring.tuning import (
    RESOLVE_FRACTIONS,
    Candidate,
    candidates,
    plan_key,
    time_candidates,
    tune,
)
from memfit.planning.plan import Plan, Region, TunedCandidate, Tuning
from memfit.planning.planner import plan_for_budget
from memfit.profiling.tracer import trace
from memfit.step.harness import Step

WIDTH = 16


class FakeClock:
    """A clock that moves only when a ``Tick`` module runs forward."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Tick(nn.Module):
    """A linear layer whose every forward call (recomputation included) costs ``cost_s``:
    on the fake clock if given, else by sleeping."""

    def __init__(self, cost_s: float, clock: FakeClock | None) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.cost_s = cost_s
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is not None:
            self.clock.t += self.cost_s
        elif self.cost_s:
            time.sleep(self.cost_s)
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, slow_s: float, fast_s: float, clock: FakeClock | None = None) -> None:
        super().__init__()
        self.slow = Tick(slow_s, clock)
        self.fast = Tick(fast_s, clock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fast(self.slow(x))


def hand_plan(path: str, recompute_s: float) -> Plan:
    """A plan recomputing one module, with a made-up prediction."""
    return Plan((Region((path,)),), predicted_peak_bytes=1000, recompute_s=recompute_s, budget_bytes=2000,
                solver="hand", profile_signature="", plain_step_s=0.001)


def net_step(net: Net) -> Step:
    torch.manual_seed(0)
    return Step.of(net, torch.randn(4, WIDTH))


def slow_and_fast_candidates() -> list[Candidate]:
    # predicted: recomputing "slow" is cheaper (listed first, so a tie or a non-measuring
    # selection would keep it); measured: it reruns the slow module in backward
    return [Candidate("recompute slow", hand_plan("slow", 1e-4)),
            Candidate("recompute fast", hand_plan("fast", 1e-2))]


# ---- the choice -------------------------------------------------------------------------------
def test_picks_the_measured_fastest_on_an_injected_clock():
    clock = FakeClock()
    net = Net(slow_s=1.0, fast_s=0.25, clock=clock)
    p = time_candidates(net_step(net), slow_and_fast_candidates(), time_limit_s=100.0, max_rounds=3,
                        progress=False, clock=clock)
    assert p.regions == (Region(("fast",)),)
    assert p.tuning is not None and p.tuning.chosen == "recompute fast"
    got = {c.name: (c.measured_s, c.rounds) for c in p.tuning.candidates}
    # a step runs each module forward once, the planned one once more in backward
    assert got == {"recompute slow": (2.0 + 0.25, 3), "recompute fast": (1.0 + 0.5, 3)}
    # warm-up (one step each) and 3 rounds of both: 4 x (2.25 + 1.5)
    assert p.tuning.spent_s == 4 * 3.75
    assert not hasattr(net, "memfit_plan") or net.__dict__.get("memfit_plan") is None


def test_picks_the_measured_fastest_with_a_module_that_sleeps():
    net = Net(slow_s=0.05, fast_s=0.0)
    p = time_candidates(net_step(net), slow_and_fast_candidates(), time_limit_s=30.0, max_rounds=3,
                        progress=False)
    assert p.tuning is not None and p.tuning.chosen == "recompute fast"
    slow, fast = p.tuning.candidates
    assert slow.measured_s is not None and fast.measured_s is not None
    # every step of "recompute slow" sleeps twice, of "recompute fast" once (sleep's lower bound)
    assert slow.measured_s >= 0.1 and fast.measured_s >= 0.05


def test_leaves_the_model_as_found():
    clock = FakeClock()
    net = Net(slow_s=1.0, fast_s=0.25, clock=clock)
    step = net_step(net)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    time_candidates(step, slow_and_fast_candidates(), time_limit_s=100.0, max_rounds=2, progress=False,
                    clock=clock)
    assert net.__dict__.get("memfit_plan") is None
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


# ---- the time limit ---------------------------------------------------------------------------
def test_time_limit_caps_rounds():
    clock = FakeClock()
    net = Net(slow_s=0.5, fast_s=0.5, clock=clock)  # every step costs 1.5 on the clock
    cands = [Candidate("a", hand_plan("slow", 0.0)), Candidate("b", hand_plan("fast", 0.0))]
    # warm-up 3.0; round 1 -> 6.0; round 2 would end at 9.0 <= 9.5: runs; round 3 (12.0) does not
    p = time_candidates(net_step(net), cands, time_limit_s=9.5, max_rounds=5, progress=False, clock=clock)
    assert p.tuning is not None
    assert [c.rounds for c in p.tuning.candidates] == [2, 2]
    assert p.tuning.spent_s == 9.0
    assert "stopped after 2 of 5 rounds: time limit 9.50 s" in p.tuning.notes


def test_slow_steps_leave_out_the_slowest_predicted_candidates():
    clock = FakeClock()
    net = Net(slow_s=0.0, fast_s=0.0, clock=clock)
    # predicted 1 s per step each: 3 candidates x (1 warm-up + 2 rounds) = 9 s > 6 s, 2 fit
    cands = [Candidate(name, Plan((Region((path,)),), 1000, s, 2000, "hand", "", plain_step_s=1.0))
             for name, path, s in [("first", "slow", 0.2), ("slowest", "fast", 0.1), ("next", "slow.lin", 0.0)]]
    p = time_candidates(net_step(net), cands, time_limit_s=6.0, max_rounds=5, progress=False, clock=clock)
    assert p.tuning is not None
    rounds = {c.name: (c.rounds, c.note) for c in p.tuning.candidates}
    # the solver's plan is always kept; of the others the predicted-fastest; rounds: 6 // 2.2 - 1
    assert rounds == {"first": (1, ""), "next": (1, ""), "slowest": (0, "not timed: time limit")}
    assert "not timed (time limit 6.00 s): slowest" in p.tuning.notes


def test_a_candidate_that_fails_is_dropped_not_chosen():
    clock = FakeClock()
    net = Net(slow_s=1.0, fast_s=0.25, clock=clock)
    bad = Candidate("no such module", hand_plan("missing", 0.0))
    p = time_candidates(net_step(net), [bad, *slow_and_fast_candidates()], time_limit_s=100.0,
                        max_rounds=2, progress=False, clock=clock)
    assert p.tuning is not None and p.tuning.chosen == "recompute fast"
    first = p.tuning.candidates[0]
    assert first.measured_s is None and first.rounds == 0 and first.note.startswith("failed: PlanMismatch")


# ---- candidates (planning only) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_profile():
    m = zoo.gpt(n_layer=4, d_model=64, n_head=2, seq_len=64, vocab_size=128)
    x = zoo.example_inputs(m, batch=2)
    return m, x, trace(m, x, repeats=1)


def test_candidates_are_distinct_and_name_every_source(gpt_profile):
    _, _, prof = gpt_profile
    cands, _ = candidates(prof, 0.5, baselines=("every_block",))
    keys = [plan_key(c.plan) for c in cands]
    assert len(set(keys)) == len(keys)
    # auto's plan is the chain solver's or the milp solver's: one candidate named after both
    assert cands[0].name in ("auto=chain", "auto=milp")
    assert sum(1 for c in cands if c.plan.solver != "every_block") <= 3


def test_every_candidate_is_a_plan_for_the_users_budget(gpt_profile):
    _, _, prof = gpt_profile
    cands, _ = candidates(prof, 0.5, baselines=("every_block",))
    budget = int(0.5 * prof.peak_bytes)
    assert [c.plan.budget_bytes for c in cands] == [budget] * len(cands)
    fractions = {f"{f:.0%}": f for f in RESOLVE_FRACTIONS}
    resolved = {c.name.split("=")[0]: c for c in cands if "@" in c.name.split("=")[0]}
    assert resolved  # the case needs a re-solve at a lower budget that found another plan
    for name, c in resolved.items():
        assert c.solved_budget_bytes == int(budget * fractions[name.split("@")[1]])
        assert c.plan.predicted_peak_bytes <= c.solved_budget_bytes
    assert all(c.solved_budget_bytes is None for c in cands if c.name.split("=")[0] not in resolved)


def test_a_chosen_resolve_reports_the_users_budget_and_records_its_own():
    clock = FakeClock()
    net = Net(slow_s=1.0, fast_s=0.25, clock=clock)
    slow, fast = slow_and_fast_candidates()
    resolve = Candidate("hand@97%", fast.plan, solved_budget_bytes=1940)  # plan budget: 2000
    p = time_candidates(net_step(net), [slow, resolve], time_limit_s=100.0, max_rounds=1,
                        progress=False, clock=clock)
    assert p.tuning is not None and p.tuning.chosen == "hand@97%"
    assert p.budget_bytes == 2000
    assert {c.name: c.solved_budget_bytes for c in p.tuning.candidates} == {"recompute slow": None,
                                                                           "hand@97%": 1940}
    assert Tuning.from_dict(json.loads(json.dumps(p.tuning.to_dict()))) == p.tuning
    assert any(ln.startswith("  * hand@97% ") and ln.endswith("(solved for 1.89 KiB)")
               for ln in str(p).splitlines())


def test_baselines_over_the_budget_are_left_out(gpt_profile):
    _, _, prof = gpt_profile
    cands, notes = candidates(prof, 0.5)
    budget = cands[0].plan.budget_bytes
    assert budget is not None
    peaks = {b: plan_for_budget(prof, budget=prof.peak_bytes, solver=b).predicted_peak_bytes
             for b in ("every_block", "sqrt", "save_matmuls")}
    over = {b for b, peak in peaks.items() if peak > budget}
    assert over and over != set(peaks)  # the case tests both sides
    named = {n for c in cands for n in c.name.split("=")}
    assert named.isdisjoint(over) and (set(peaks) - over) <= named
    assert all(c.plan.predicted_peak_bytes <= budget for c in cands)
    assert sorted(n.split(":")[0] for n in notes) == sorted(f"left out {b}" for b in over)


# ---- the record -------------------------------------------------------------------------------
RECORD = Tuning(
    candidates=(TunedCandidate("auto=milp", "milp", 3_000_000, 0.125, 0.150, 3),
                TunedCandidate("sqrt", "sqrt", 2_900_000, 0.140, 0.131, 3),
                TunedCandidate("every_block", "every_block", 2_000_000, 0.160, None, 0, "not timed: time limit")),
    chosen="sqrt", time_limit_s=1.0, spent_s=0.95, notes=("left out save_matmuls: over budget",))


def test_record_round_trips_through_json_and_shows_in_str(tmp_path):
    p = Plan((Region(("blocks.0",)),), 2_900_000, 0.04, 3_000_000, "sqrt", "sig", 5_000_000, 0.1, "GPT",
             tuning=RECORD)
    p.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back.tuning == RECORD
    text = str(back)
    assert "tuned: 2 of 3 candidates timed on the model in 950.0 ms (limit 1.00 s); chose sqrt" in text
    lines = text.splitlines()
    assert any(ln.startswith("  * sqrt ") and "131.0 ms" in ln for ln in lines)
    assert any(ln.startswith("    auto=milp ") and "150.0 ms" in ln for ln in lines)
    assert "not timed: time limit" in text and "left out save_matmuls" in text


def test_a_plan_file_without_a_record_reads_as_untuned():
    p = Plan((Region(("a",)),), 1, 0.0, None, "milp", "")
    data = p.to_dict()
    del data["tuning"]
    assert Plan.from_dict(json.loads(json.dumps(data))).tuning is None


# ---- end to end -------------------------------------------------------------------------------
def test_tune_on_a_gpt_returns_a_timed_candidate_within_budget(gpt_profile):
    m, x, prof = gpt_profile
    p = tune(Step.of(m, x), prof, 0.5, time_limit_s=5.0, max_rounds=2, progress=False)
    assert p.tuning is not None and p.budget_bytes is not None
    chosen = next(c for c in p.tuning.candidates if c.name == p.tuning.chosen)
    assert chosen.measured_s is not None and chosen.rounds >= 1
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert m.__dict__.get("memfit_plan") is None


def test_fit_with_tune_applies_the_chosen_plan_with_its_record():
    from memfit.api import fit

    m = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64)
    x = zoo.example_inputs(m, batch=2)
    assert fit(m, x, budget=0.5, search=memfit.Search(tune=True, tune_time_limit_s=2.0)) is m
    p = m.memfit_plan
    assert p.tuning is not None and p.budget_bytes is not None
    assert p.tuning.chosen in {c.name for c in p.tuning.candidates if c.measured_s is not None}
    assert p.predicted_peak_bytes <= p.budget_bytes


def test_fit_with_tune_refuses_a_meta_model():
    from memfit.api import fit

    with torch.device("meta"):
        m = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="tune=True"):
        fit(m, torch.ones(2, 4, device="meta"), budget=0.5, search=memfit.Search(tune=True))


def test_cli_plan_tune_writes_the_record(tmp_path, capsys):
    from memfit.cli.main import EXIT_OK, main

    out = tmp_path / "plan.json"
    code = main(["plan", "gpt:n_layer=3,d_model=32,n_head=2,seq_len=32,vocab_size=64,batch=2",
                 "--budget", "50%", "--tune", "--tune-limit", "2", "--no-progress", "-o", str(out)])
    assert code == EXIT_OK
    assert "tuned:" in capsys.readouterr().out
    p = Plan.load(out)
    assert p.tuning is not None and p.tuning.time_limit_s == 2.0


def test_cli_plan_tune_refuses_another_target(capsys):
    from memfit.cli.main import EXIT_BAD_INPUT, main

    code = main(["plan", "gpt:n_layer=1,d_model=16,n_head=2,seq_len=8,vocab_size=32,batch=1",
                 "--budget", "50%", "--tune", "--target", "h100"])
    assert code == EXIT_BAD_INPUT
    assert "--tune times real steps" in capsys.readouterr().err
