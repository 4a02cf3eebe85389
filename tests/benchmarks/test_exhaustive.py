"""The exhaustive per-block search of benchmarks/exhaustive.py against memfit's solvers."""

from __future__ import annotations

import pytest
from benchmarks.exhaustive import CHOICES, block_options, search

from memfit import zoo
from memfit.planning.candidates import PlanningContext
from memfit.planning.plan import Plan, Region
from memfit.planning.simulate import simulate
from memfit.planning.solvers import milp
from memfit.profiling.tracer import trace


@pytest.fixture(scope="module")
def tiny_gpt_profile():
    model = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64)
    return trace(model, zoo.example_inputs(model, batch=2), repeats=1)


def test_block_options_are_the_four_hand_choices(tiny_gpt_profile):
    ctx = PlanningContext(tiny_gpt_profile)
    opts = block_options(ctx, "blocks.0")
    assert [name for name, _ in opts] == list(CHOICES)
    cand = ctx.candidate(("blocks.0",))
    keep, matmuls, but_core, recompute = (
        ops if ops is None else tuple(cand.choices[j].op for j in ops) for _, ops in opts)
    prof = tiny_gpt_profile
    assert keep is None and recompute == ()
    assert matmuls and all(prof.ops[i].name.split(".")[1] in ("mm", "addmm", "bmm") for i in matmuls)
    # the attention core (T x T per head) is what "all but the core" leaves out
    assert set(matmuls) - set(but_core) and len(but_core) > len(matmuls)
    assert all(not (len(t.shape) >= 3 and t.shape[-1] == t.shape[-2] == 32)
               for i in but_core for t in prof.ops[i].outputs)


def test_search_is_exact_and_never_beats_memfit(tiny_gpt_profile):
    prof = tiny_gpt_profile
    blocks = ("blocks.0", "blocks.1", "blocks.2")
    every = simulate(prof, Plan(tuple(Region((b,)) for b in blocks), 0, 0.0, None, "t", ""))
    found = search(prof, blocks, every.peak_bytes, top=3)
    assert found["plans_searched"] == 4 ** 3 and found["feasible"] >= 1
    times = [b["recompute_s"] for b in found["best"]]
    assert times == sorted(times)
    for b in found["best"]:
        plan = Plan(tuple(Region.saving((m,), keys) for m, keys in b["regions"]), 0, 0.0, None, "t", "")
        sim = simulate(prof, plan)
        # disjoint block regions: the linear model is the simulator
        assert sim.peak_bytes == b["predicted_peak_bytes"] <= every.peak_bytes
        assert sim.recompute_s == pytest.approx(b["recompute_s"], rel=1e-12)
    # memfit's MILP searches a superset (every module, every save set): never slower
    sol = milp.solve(PlanningContext(prof), every.peak_bytes)
    assert sol.recompute_s <= found["best"][0]["recompute_s"] + 1e-12
