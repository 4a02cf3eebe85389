"""DeepSpeed's engine (ZeRO stage 1, 2 or 3) on 2 gloo ranks, with and without memfit.

Run by ``torch.distributed.run`` from ``test_deepspeed.py`` with DeepSpeed importable. The zoo
GPT with dropout, 3 AdamW steps (``torch_adam``) from the same weights, batches and seeds:
the plain engine, then ``memfit.integrations.deepspeed.initialize`` with the budget in the
config's ``"memfit"`` block. Each rank's weights are compared with ``torch.equal`` (under
ZeRO-3, its partition: the parameters themselves are empty placeholders). Writes
``$MEMFIT_DIST_OUT/rank<r>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402  # type: ignore[import-not-found]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from memfit.integrations import deepspeed as memfit_ds  # noqa: E402
from memfit.profiling.meters import AllocatorMeter  # noqa: E402
from memfit.zoo.gpt import gpt  # noqa: E402

STEPS = 3


def config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100000,
                                  "allgather_bucket_size": 100000}}


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's weights: under ZeRO-3 its partition of each (``ds_tensor``)."""
    return {n: getattr(q, "ds_tensor", q).detach().clone()
            for n, q in engine.module.named_parameters()}


def train(engine: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """3 steps; the weights after them and the last step's measured forward + backward peak
    (the CPU allocator's, gradients' reduction included)."""
    peak = 0
    for i in range(STEPS):
        torch.manual_seed(10 + i)  # the same dropout masks in both runs
        with AllocatorMeter() as alloc:
            loss = engine(x, y)
            engine.backward(loss)
        peak = alloc.peak_bytes
        engine.step()
    return weights(engine), peak


def main() -> None:
    stage = int(sys.argv[1])
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    base = gpt(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=128, dropout=0.1, seed=0)
    g = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    x = torch.randint(0, 128, (2, 32), generator=g)
    y = torch.randint(0, 128, (2, 32), generator=g)
    out: dict[str, Any] = {"rank": rank}
    plain_engine, *_ = deepspeed.initialize(model=copy.deepcopy(base), config=config(stage),
                                            model_parameters=None)
    plain, out["plain_measured_bytes"] = train(plain_engine, x, y)
    model = copy.deepcopy(base)
    cfg = {**config(stage), "memfit": {"budget": 0.6}}
    engine, *_ = memfit_ds.initialize(model=model, config=cfg, example_inputs=(x, y),
                                      model_parameters=model.parameters())
    out["config_unchanged"] = cfg == {**config(stage), "memfit": {"budget": 0.6}}
    p = model.memfit_plan
    out.update(regions=[list(r.modules) for r in p.regions], budget_bytes=p.budget_bytes,
               predicted_peak_bytes=p.predicted_peak_bytes, plain_peak_bytes=p.plain_peak_bytes)
    initial = weights(engine)
    planned, out["measured_bytes"] = train(engine, x, y)
    out["n_weights"] = len(plain)
    out["elements"] = sum(t.numel() for t in planned.values())
    out["unequal"] = sorted(n for n in plain if not torch.equal(plain[n], planned[n]))
    out["trained"] = sorted(n for n in initial if not torch.equal(initial[n], planned[n]))
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
