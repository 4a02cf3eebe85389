"""Probe: does memfit's plan train bitwise under a DeepSpeed engine (ZeRO 0-3) on CPU?

Not a memfit integration and not in CI (DeepSpeed is no dependency). Run on 2 gloo ranks with
DeepSpeed importable (here: ``pip install --no-build-isolation --target DIR deepspeed hjson
ninja py-cpuinfo msgpack --no-deps``, then ``PYTHONPATH=DIR:src``)::

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 --standalone \\
        benchmarks/deepspeed_probe.py STAGE [before|after]

``before``: ``memfit.fit(model)`` then ``deepspeed.initialize``; ``after``: ``fit(engine.module)``.
Prints, per rank, how many parameters differ (``torch.equal``) from the same engine without
memfit after 3 AdamW steps, or the error. Findings: docs/distributed.md, "DeepSpeed".
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run(stage: int, planned: str | None) -> dict[str, torch.Tensor]:
    import deepspeed  # type: ignore[import-not-found]
    import torch.distributed as dist

    import memfit
    from memfit.zoo.gpt import gpt

    model = gpt(n_layer=2, d_model=32, n_head=2, seq_len=32, vocab_size=128, dropout=0.1, seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100000,
                                 "allgather_bucket_size": 100000}}
    if not dist.is_initialized():
        deepspeed.init_distributed("gloo")
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randint(0, 128, (2, 32), generator=g)
    y = torch.randint(0, 128, (2, 32), generator=g)
    if planned == "before":
        memfit.fit(model, (x, y), budget=0.6)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    if planned == "after":
        memfit.fit(engine.module, (x, y), budget=0.6)
    for i in range(3):
        torch.manual_seed(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    # ZeRO-3 leaves each parameter an empty placeholder: compare the rank's partition.
    return {n: getattr(q, "ds_tensor", q).detach().clone()
            for n, q in engine.module.named_parameters()}


def main() -> None:
    import torch.distributed as dist

    stage, order = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "before"
    plain = run(stage, None)
    try:
        planned = run(stage, order)
        bad = [n for n in plain if not torch.equal(plain[n], planned[n])]
        outcome = f"{len(bad)} of {len(plain)} parameters differ"
    except Exception as e:  # the finding is the error
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"rank {dist.get_rank()} ZeRO-{stage} fit {order} initialize: {outcome}", flush=True)


if __name__ == "__main__":
    main()
