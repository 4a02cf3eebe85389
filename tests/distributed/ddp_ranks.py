"""Per rank: ``fit`` with DDP in either order, then 3 AdamW steps against plain DDP.

``python -m torch.distributed.run ... ddp_ranks.py {fit-then-wrap|fit-wrapped}``."""

from __future__ import annotations

import sys

from rank_common import batch, full_weights, gather, llama, same_weights, setup, train, write
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit
from memfit.parallel.distributed import plan_digest

order = sys.argv[1]
rank = setup()
plain = llama()
plain.config.use_cache = False
reference = full_weights(train(DDP(plain), rank))

model = llama()
if order == "fit-then-wrap":
    memfit.fit(model, batch(), budget=0.6)
    plan = model.memfit_plan
    planned = DDP(model)
else:
    planned = memfit.fit(DDP(model), batch(), budget=0.6)
    plan = planned.memfit_plan
weights = full_weights(train(planned, rank))
write(rank, {
    "plans": gather(plan.to_dict()),
    "digest": plan_digest(plan),
    "regions": len(plan.regions),
    "unequal": same_weights(weights, reference),
    "n_weights": len(weights),
})
