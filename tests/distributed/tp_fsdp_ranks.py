"""Tensor parallelism x FSDP2 on a 2D mesh (data-parallel x tensor-parallel, 2 x 2), on 4 gloo
ranks; run by ``torch.distributed.run`` from ``test_tensor_parallel.py``.

Two transformer blocks of ``tp_blocks_ranks.py`` (attention split by heads, Megatron MLP),
each block ``parallelize_module``-d on the mesh's ``tp`` dimension, then ``fully_shard``-ed
on its ``dp`` dimension (torchtitan's order: TP first, FSDP over it), the root too. Each
data-parallel rank has its own batch. memfit profiles the sharded model, plans once for the
job at ``"min"`` and at every-block checkpointing's predicted peak, and each plan's step is
compared with plain TP x FSDP2: the measured peak (smallest of 3 steps: NOTE [collective
outputs held by gloo] in ``test_tensor_parallel.py``) and every gradient (``full_tensor()``)
with ``torch.equal``. Writes ``$MEMFIT_DIST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from tp_blocks_ranks import ATTN_PLAN, Block, Net, step

import memfit
from memfit.parallel.distributed import gather_ranks, plan_once, rank_report


def _local(p: torch.Tensor) -> torch.Tensor:
    """A TP-sharded parameter's shard (a DTensor's local tensor), or the parameter itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    base = Net([Block(64, 4) for _ in range(2)])
    # one batch per data-parallel rank, shared by its tensor-parallel pair
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(1 + dp))

    gather_bytes: list[int] = []  # each block's FSDP all-gather output: its TP-local parameters

    def sharded() -> Net:
        m = copy.deepcopy(base)
        gather_bytes.clear()
        for b in m.blocks:
            parallelize_module(b, mesh["tp"], ATTN_PLAN)
            gather_bytes.append(sum(p.numel() * p.element_size() for p in map(_local, b.parameters())))
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m

    plain = step(sharded(), x)
    out: dict[str, Any] = {"rank": rank, "dp": dp, "tp": mesh["tp"].get_local_rank(),
                           "plain_peak": plain["peak"], "plain_peaks": plain["peaks"],
                           "n_grads": len(plain["grads"]), "fsdp_gather_bytes": max(gather_bytes),
                           "plans": {}}
    peer = sharded()
    peer.every_block = True
    got = step(peer, x)
    out["plans"]["every_block"] = {"peak": got["peak"], "peaks": got["peaks"], "unequal": sorted(
        n for n, g in plain["grads"].items() if not torch.equal(g, got["grads"][n]))}
    prof = memfit.profile(sharded(), x)
    cal = prof.calibration
    out["calibration"] = {"reason": cal.reason, "charges_measured": list(cal.charges_measured)} if cal else None
    every = plan_once(lambda: memfit.plan(prof, budget=1.0, solver="every_block"))
    for name, budget in (("min", "min"), ("at_every_block_peak", every.predicted_peak_bytes)):
        plan = plan_once(lambda b=budget: memfit.plan(prof, budget=b))
        model = sharded()
        memfit.apply(model, plan)
        got = step(model, x)
        report = rank_report(plan, measured_peak_bytes=got["peak"])
        out["plans"][name] = {
            "peak": got["peak"], "peaks": got["peaks"], "regions": [list(r.modules) for r in plan.regions],
            "report": report.to_dict(), "every_rank": [r.to_dict() for r in gather_ranks(report)],
            "unequal": sorted(n for n, g in plain["grads"].items() if not torch.equal(g, got["grads"][n]))}
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads at interpreter exit (rank_common.write)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
