"""Per rank: what ``apply`` and ``fit`` raise when the ranks disagree, on every rank.

- ``plans-differ``: rank r applies a plan over ``model.layers.<r>`` (then again with
  ``check_ranks=False``, which applies it);
- ``cannot-apply``: every rank applies the same plan, but rank 1's model lacks its module;
- ``infeasible``: ``fit`` with a budget the source rank cannot meet (only rank 0 plans).

``python -m torch.distributed.run ... errors_ranks.py <case>``."""

from __future__ import annotations

import sys

from rank_common import batch, llama, setup, write

import memfit
from memfit import Plan, Region

case = sys.argv[1]
rank = setup()
model = llama()
if case == "plans-differ":
    layer = rank
elif case == "cannot-apply":
    layer = 5
    if rank == 1:
        del model.model.layers[5]
try:
    if case == "infeasible":
        # 1 byte: below any plan's peak. The chain solver finds that in 0.6 s; "auto" searches
        # 44 s for the smallest peak (the other rank waits in the broadcast meanwhile)
        memfit.fit(model, batch(), budget=1, search=memfit.Search(solver="chain"))
    else:
        memfit.apply(model, Plan((Region((f"model.layers.{layer}",)),), 0, 0.0, None, "hand", ""))
    result = {"raised": None}
except memfit.MemfitError as e:
    result = {"raised": type(e).__name__, "message": str(e),
              "ranks": {k: list(v) for k, v in getattr(e, "ranks", {}).items()},
              "min_feasible_bytes": getattr(e, "min_feasible_bytes", None),
              "budget_bytes": getattr(e, "budget_bytes", None)}
result["carries_plan"] = "memfit_plan" in model.__dict__
if case == "plans-differ":  # the opt-out: each rank applies its own plan, no collective
    plan = Plan((Region((f"model.layers.{layer}",)),), 0, 0.0, None, "hand", "")
    result["unchecked_applied"] = memfit.apply(model, plan, check_ranks=False).memfit_plan is plan
write(rank, result)
