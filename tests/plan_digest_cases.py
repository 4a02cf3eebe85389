"""The plans the layering refactor must leave unchanged: three zoo models profiled in fake mode
for a GPU preset (deterministic: roofline op times, no clock), planned at three budgets and for a
whole-card job. ``python -m tests.plan_digest_cases > tests/data/plan_digests.json`` writes the
record that tests/test_plan_digests.py compares against (written at the commit named in it)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import memfit

BUDGETS: tuple[Any, ...] = (0.9, 0.7, 0.5, "min")


def models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    gpt = memfit.zoo.gpt(n_layer=4, d_model=64, n_head=4, seq_len=64, vocab_size=256)
    resnet = memfit.zoo.build("resnet")
    unet = memfit.zoo.build("unet3d")
    return {
        "gpt": (gpt, memfit.zoo.example_inputs(gpt, batch=4)),
        "resnet": (resnet, memfit.zoo.example_inputs(resnet, batch=4)),
        "unet3d": (unet, memfit.zoo.example_inputs(unet, batch=1)),
    }


def digest(plan: memfit.Plan) -> str:
    """sha256 of the plan's regions, decisions, predicted peak and recompute figures."""
    data = plan.to_dict()
    kept = {k: data[k] for k in ("regions", "predicted_peak_bytes", "recompute_time_s",
                                 "recompute_flops", "budget_bytes", "memory") if k in data}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def plans() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, (model, x) in models().items():
        torch.manual_seed(0)
        prof = memfit.profile(model, x, mode="fake", target="h100")
        for budget in BUDGETS:
            try:
                out[f"{name}@{budget}"] = _record(memfit.plan(prof, budget=budget))
            except memfit.InfeasibleBudget as e:  # the message names the smallest feasible peak
                out[f"{name}@{budget}"] = {"infeasible": str(e)}
        job = memfit.Job(device="h100", optimizer="adamw")
        out[f"{name}@job"] = _record(memfit.plan(prof, job))
    return out


def _record(p: memfit.Plan) -> dict[str, Any]:
    return {"digest": digest(p), "peak": p.predicted_peak_bytes, "regions": len(p.regions)}


if __name__ == "__main__":
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    json.dump({"commit": commit, "torch": torch.__version__, "plans": plans()}, sys.stdout,
              indent=1, sort_keys=True)
    print()
