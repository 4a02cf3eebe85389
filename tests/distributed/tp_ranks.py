"""Tensor parallelism (DTensor ``ColwiseParallel`` / ``RowwiseParallel``) on 2 gloo ranks.

Run by ``torch.distributed.run`` from ``test_tensor_parallel.py``. The zoo GPT with each MLP
split Megatron-style (``fc`` column-wise, ``proj`` row-wise: one all-reduce per MLP); plain TP
and TP planned by ``memfit.fit`` after ``parallelize_module``, 3 AdamW steps each from the
same weights and seeds; full weights (``full_tensor()``) compared with ``torch.equal``.
Writes ``$MEMFIT_DIST_OUT/rank<r>.json``.
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import memfit
from memfit.profiling.meters import AllocatorMeter
from memfit.zoo.gpt import gpt

STEPS = 3


def tp(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    for block in model.blocks:
        parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return model


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(STEPS):
        torch.manual_seed(10 + i)  # the same dropout masks on both ranks and both models
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: (q.full_tensor() if isinstance(q, DTensor) else q).detach().clone()
            for n, q in model.named_parameters()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = gpt(n_layer=2, d_model=64, n_head=2, seq_len=64, vocab_size=256, seed=0)
    plain, planned = tp(copy.deepcopy(base), mesh), tp(copy.deepcopy(base), mesh)
    g = torch.Generator().manual_seed(5)  # the same batch on both ranks: TP shares one batch
    x = torch.randint(0, 256, (2, 64), generator=g)
    y = torch.randint(0, 256, (2, 64), generator=g)
    out: dict[str, Any] = {"rank": rank}
    try:
        memfit.fit(planned, (x, y), budget=0.75)
        p = planned.memfit_plan
        out.update(regions=[list(r.modules) for r in p.regions],
                   predicted_peak_bytes=p.predicted_peak_bytes, budget_bytes=p.budget_bytes,
                   plain_peak_bytes=p.plain_peak_bytes)
    except Exception as e:  # reported, not hidden: the test shows it
        out["fit_error"] = f"{type(e).__name__}: {e}"[:2000]
    a, b = train(plain, x, y), train(planned, x, y)
    # the planned step's measured peak (CPU allocator), forward + backward, grads existing
    for m in (plain, planned):
        torch.manual_seed(20)
        with AllocatorMeter() as alloc:
            m(x, y).backward()
        out["measured_bytes" if m is planned else "plain_measured_bytes"] = alloc.peak_bytes
    out["n_weights"] = len(a)
    out["unequal"] = sorted(n for n in a if not torch.equal(a[n], b[n]))
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
