"""The linear cost model adds up to simulate() exactly on random plans of random profiles."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from profile_builders import random_chain, random_unet

from memfit.planning.candidates import PlanningContext
from memfit.planning.costs import LinearModel
from memfit.planning.plan import Plan
from memfit.planning.simulate import simulate


def _random_plan(rng: random.Random, cands):
    chosen, used = [], []
    for c in rng.sample(cands, len(cands)):
        if any(not (c.b < a or c.a > b) for a, b in used) or rng.random() < 0.5:
            continue
        chosen.append((c.index, tuple(j for j in range(len(c.choices)) if rng.random() < 0.4)))
        used.append((c.a, c.b))
    return chosen


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["chain", "dropout", "unet"]), ws=st.booleans())
def test_linear_model_equals_simulate(seed, kind, ws):
    # ws: random kernel workspaces per op (counted at their op and at replayed, unsaved ops);
    # dropout: chains with dropout, whose draws plans may keep (NOTE [kept draws])
    rng = random.Random(seed)
    prof = (random_unet(rng, workspace=ws) if kind == "unet"
            else random_chain(rng, workspace=ws, dropout=kind == "dropout"))
    ctx = PlanningContext(prof)
    cands = ctx.region_candidates()
    lm = LinearModel(ctx, cands)
    for _ in range(5):
        chosen = _random_plan(rng, cands)
        sim = simulate(prof, Plan(tuple(cands[r].region(ops) for r, ops in chosen), 0, 0.0, None, "t", ""))
        total = lm.timeline(chosen)
        # op positions agree point by point; each chosen region's replay too
        assert list(total[: len(prof.ops)]) == [v for v, rep in _positions(sim)]
        assert lm.peak(chosen) == sim.peak_bytes
        assert lm.time_s(chosen) == sim.recompute_s  # dyadic times: exact sums


def _positions(sim):
    seen = set()
    out = []
    # the last entry of each position is the op itself (replay entries come first)
    for k in range(len(sim.live_bytes) - 1, -1, -1):
        p = sim.positions[k]
        if p not in seen:
            seen.add(p)
            out.append((sim.live_bytes[k], False))
    return list(reversed(out))
