"""Per rank: ``fit`` with FSDP2 (``fully_shard`` per decoder layer and the root) in either
order, ``verify``, then 3 AdamW steps against plain FSDP2.

``python -m torch.distributed.run ... fsdp_ranks.py {shard-then-fit|fit-then-shard}``."""

from __future__ import annotations

import sys

import torch
from rank_common import batch, full_weights, gather, llama, same_weights, setup, train, write
from torch.distributed.fsdp import fully_shard

import memfit
from memfit import OpPolicy, Plan, Region
from memfit.ops import KEPT_DRAW_OPS

order = sys.argv[1]
rank = setup()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


plain = llama()
plain.config.use_cache = False
reference = full_weights(train(shard(plain), rank))

model = llama()
if order == "shard-then-fit":
    memfit.fit(shard(model), batch(), budget=0.6)
else:
    # per-block regions: a budgeted plan made before sharding may hold a segment over two
    # blocks, which becomes two FSDP units once sharded (docs/distributed.md, limits)
    memfit.fit(model, batch(), budget=0.6, search=memfit.Search(solver="every_block"))
    shard(model)
plan = model.memfit_plan
report = memfit.verify(model, batch())
# The dropout masks the plan keeps (NOTE [kept draws]; Llama draws only the attention's): one
# byte per element of the (batch, heads, time, time) mask and a generator state each.
b, t = batch()["input_ids"].shape
kept_draws = sum(k.rsplit("#", 1)[0] in KEPT_DRAW_OPS and v is OpPolicy.SAVE
                 for r in plan.regions for k, v in r.ops)
mask_bytes = b * model.config.num_attention_heads * t * t
weights = full_weights(train(model, rank))
refused = {}  # plans that put FSDP units inside a region: refused by apply, on every rank
for name, region in [("segment", ("model.layers.0", "model.layers.1")), ("holder", ("model",))]:
    try:
        memfit.apply(model, Plan((Region(region),), 0, 0.0, None, "hand", ""))
        refused[name] = None
    except memfit.MemfitError as e:
        refused[name] = f"{type(e).__name__}: {e}"
write(rank, {
    "refused": refused,
    "plans": gather(plan.to_dict()),
    "regions": len(plan.regions),
    "kept_draw_bytes": kept_draws * (mask_bytes + torch.get_rng_state().nbytes),
    "verify": report.to_dict(),
    "verify_text": str(report),
    "unequal": same_weights(weights, reference),
    "n_weights": len(weights),
})
