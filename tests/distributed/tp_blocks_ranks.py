"""Tensor-parallel blocks whose regions hold collectives (NOTE [collectives in a region] in
``memfit.planning.rules``), on 2 gloo ranks; run by ``torch.distributed.run`` from
``test_tensor_parallel.py`` with one case name:

- ``mlp``: four Megatron blocks ``x + mlp(ln(x))`` (d 128, ``fc`` column-wise, ``proj``
  row-wise: one all-reduce per block), batch 8 x 256. Plain TP, torch's ``checkpoint`` on
  every block, and memfit planned at ``"min"``, 0.6 and 0.8 of the profiled peak.
- ``attn``: two transformer blocks, attention split by heads (q, k, v column-wise, out
  row-wise) and a Megatron MLP: memfit at ``"min"``, and hand-made plans over block 0 that
  re-run the attention's all-reduce or keep its output (Megatron's selective recompute).
- ``sp``: the ``attn`` blocks with sequence parallelism (``SequenceParallel`` norms, the
  residual stream sharded by tokens): memfit at ``"min"``.

With a second argument ``rounds`` (``benchmarks/tp_recompute.py``), every model's step is
then timed in that many interleaved rounds (all ranks in step; the median is reported).

Each planned model is compared with plain TP on one step: the measured peak (CPU allocator,
forward + backward, gradients allocated), every gradient (``full_tensor()``) with
``torch.equal``, and the all-reduces the backward ran. Writes ``$MEMFIT_DIST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import memfit
from memfit.parallel.distributed import gather_ranks, plan_once, rank_report
from memfit.planning.collectives import replayed_collectives
from memfit.planning.plan import OpPolicy, Plan, Region
from memfit.profiling.meters import AllocatorMeter


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Attention(nn.Module):
    """Causal self-attention whose head count follows the width of ``q``'s output: under
    column-wise ``q``, ``k``, ``v`` each rank holds ``n_head / world`` heads."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d // n_head
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (b, heads here, t, hd)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # (b, heads here, t, hd)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))          # (b, t, d)


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, n_head), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.every_block = False  # torch's checkpoint on every block, the peer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.every_block else b(x)
        if isinstance(x, DTensor):  # sequence parallel: the loss over every rank's tokens
            x = x.full_tensor()
        return x.pow(2).mean()


MLP_PLAN = {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
ATTN_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
             "attn.out": RowwiseParallel(), **MLP_PLAN}
# Sequence parallelism: the norms run on each rank's tokens, the attention and the MLP gather
# them first and scatter their output back (Megatron-SP, as torchtitan lays it out).
SP_PLAN = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
           "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
           "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.out": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
           "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
           "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def build(case: str) -> tuple[nn.Module, dict[str, Any], torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)  # the same batch on every rank: TP shares one batch
    if case == "mlp":
        return Net([MLPBlock(128) for _ in range(4)]), MLP_PLAN, torch.randn(8, 256, 128, generator=g)
    x = torch.randn(4, 64, 64, generator=g)
    return Net([Block(64, 4) for _ in range(2)]), SP_PLAN if case == "sp" else ATTN_PLAN, x


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched while it is entered, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


ALL_REDUCE = "_c10d_functional.all_reduce.default"


def step(model: nn.Module, x: torch.Tensor, repeats: int = 3) -> dict[str, Any]:
    """``repeats`` forward + backward steps: their allocator peaks (NOTE [collective outputs
    held by gloo] in ``test_tensor_parallel.py``), the last one's gradients and the
    collectives its backward ran."""
    peaks = []
    for _ in range(repeats):
        for p in model.parameters():
            p.grad = None
        with AllocatorMeter() as alloc:
            loss = model(x)
            with CountOps() as count:
                loss.backward()
        peaks.append(alloc.peak_bytes)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}
    return {"peak": min(peaks), "peaks": peaks, "grads": grads,
            "backward_collectives": sum(v for k, v in count.counts.items() if k.startswith("_c10d_functional.")
                                        and "wait_tensor" not in k and "wrap" not in k)}


def timed(models: dict[str, nn.Module], x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds of one forward + backward of each model, ``rounds`` times, the models
    interleaved in every round (one warm-up round first); ranks start each step together."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, model in models.items():
            for p in model.parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            model(x).backward()
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    case = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base, layout, x = build(case)

    def tp() -> nn.Module:
        m = copy.deepcopy(base)
        for b in m.blocks:
            parallelize_module(b, mesh, layout)
        return m

    if case == "sp":  # the residual stream enters sharded by tokens
        x = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
    models: dict[str, nn.Module] = {"plain": tp()}
    plain = step(models["plain"], x)
    out: dict[str, Any] = {"rank": rank, "plain_peak": plain["peak"], "plain_peaks": plain["peaks"],
                           "plain_backward_collectives": plain["backward_collectives"],
                           "n_grads": len(plain["grads"]), "plans": {}}

    def record(name: str, model: nn.Module, plan: Plan | None) -> None:
        models[name] = model
        got = step(model, x)
        row = {"peak": got["peak"], "peaks": got["peaks"], "backward_collectives": got["backward_collectives"],
               "unequal": sorted(n for n, g in plain["grads"].items() if not torch.equal(g, got["grads"][n]))}
        if plan is not None:
            report = rank_report(plan, measured_peak_bytes=got["peak"])
            row.update(regions=[list(r.modules) for r in plan.regions], report=report.to_dict(),
                       every_rank=[r.to_dict() for r in gather_ranks(report)],
                       saves=[k for r in plan.regions for k in r.save])
        out["plans"][name] = row

    peer = tp()
    peer.every_block = True
    record("every_block", peer, None)
    prof = memfit.profile(tp(), x)
    out["profile_peak"] = prof.peak_bytes
    cal = prof.calibration  # timed on this rank, with the job's plans (NOTE [calibration])
    out["calibration"] = {"reason": cal.reason, "charges_measured": list(cal.charges_measured)} if cal else None
    every = plan_once(lambda: memfit.plan(prof, budget=1.0, solver="every_block"))  # rank 0's numbers
    out["every_block_recompute_s"] = every.recompute_s
    out["every_block_collectives"] = replayed_collectives(prof, every.regions).to_dict()
    budgets: list[Any] = ["min", 0.6, 0.8] if case == "mlp" else ["min"]
    # and at the peak memfit predicts for every-block checkpointing: the fastest plan there
    for name, budget in [(str(b), b) for b in budgets] + [("at_every_block_peak", every.predicted_peak_bytes)]:
        plan = plan_once(lambda b=budget: memfit.plan(prof, budget=b))
        model = tp()
        memfit.apply(model, plan)
        record(name, model, plan)
    if case == "attn":  # block 0 recomputed whole, or with its attention's all-reduce kept
        key = f"{ALL_REDUCE}#0"
        for name, ops in (("block0_full", {}), ("block0_keep_all_reduce", {key: OpPolicy.SAVE})):
            region = Region(("blocks.0",), ops)
            plan = Plan((region,), 0, 0.0, None, "hand", prof.signature)
            model = tp()
            memfit.apply(model, plan)
            record(name, model, plan)
            out["plans"][name]["predicted_collectives"] = replayed_collectives(prof, plan.regions).to_dict()
    if rounds:
        out["step_s"] = timed(models, x, rounds)
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads at interpreter exit (rank_common.write)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
