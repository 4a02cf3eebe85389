"""DeepSpeed's engine (ZeRO stage 1, 2 or 3) on 2 gloo ranks, with and without memfit.

Run by ``torch.distributed.run`` from ``test_deepspeed.py`` with DeepSpeed importable, as
``deepspeed_ranks.py STAGE MODEL BUCKET [release]``: MODEL ``gpt`` (the zoo GPT with dropout), ``llama``
or ``gpt2`` (Hugging Face, built from a config, attention dropout on); BUCKET the
``reduce_bucket_size`` and ``allgather_bucket_size`` in elements, or ``default`` (DeepSpeed's);
``release``: under ZeRO-3, ``stage3_param_persistence_threshold`` 100, so the parameters over
100 elements are gathered and released (DeepSpeed's default 1e5 keeps these models' whole).
3 AdamW steps (``torch_adam``) from the same weights, batches and seeds:
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

from memfit.errors import InfeasibleBudget  # noqa: E402
from memfit.integrations import deepspeed as memfit_ds  # noqa: E402
from memfit.profiling.meters import AllocatorMeter  # noqa: E402
from memfit.zoo.gpt import gpt  # noqa: E402

STEPS = 3
RELEASE = len(sys.argv) > 4 and sys.argv[4] == "release"


def config(stage: int, bucket: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if bucket != "default":
        zero.update(reduce_bucket_size=int(float(bucket)), allgather_bucket_size=int(float(bucket)))
    if stage == 3 and RELEASE:  # parameters over 100 elements gathered and released
        zero.update(stage3_param_persistence_threshold=100)
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": zero}


def build(kind: str) -> tuple[torch.nn.Module, int]:
    """The model and its sequence length."""
    if kind == "gpt":
        return gpt(n_layer=2, d_model=32, n_head=2, seq_len=96, vocab_size=128, dropout=0.1,
                   seed=0), 96
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176,
                                       num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=96,
                                       attention_dropout=0.1)
        return transformers.LlamaForCausalLM(cfg).train(), 96
    cfg2 = transformers.GPT2Config(vocab_size=128, n_positions=96, n_embd=64, n_layer=3, n_head=4,
                                   bos_token_id=0, eos_token_id=0)  # dropouts 0.1 by default
    return transformers.GPT2LMHeadModel(cfg2).train(), 96


def forward(kind: str, engine: Any, ids: torch.Tensor) -> Any:
    """The model's output: the loss (the zoo GPT), or Hugging Face's output, held through
    backward as a training loop holds ``outputs`` (and as memfit's profile of the step
    does: its logits are live in backward)."""
    return engine(ids, ids) if kind == "gpt" else engine(input_ids=ids, labels=ids)


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's weights: under ZeRO-3 its partition of each (``ds_tensor``)."""
    return {n: getattr(q, "ds_tensor", q).detach().clone()
            for n, q in engine.module.named_parameters()}


def train(kind: str, engine: Any, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[int]]:
    """3 steps; the weights after them and each step's measured forward + backward peak (the
    CPU allocator's, gradients' reduction included)."""
    peaks = []
    for i in range(STEPS):
        torch.manual_seed(10 + i)  # the same dropout masks in both runs
        with AllocatorMeter() as alloc:
            outputs = forward(kind, engine, ids)
            engine.backward(outputs if kind == "gpt" else outputs.loss)
            del outputs
        peaks.append(alloc.peak_bytes)
        engine.step()
    return weights(engine), peaks


def main() -> None:
    stage, kind, bucket = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    base, seq = build(kind)
    g = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
    ids = torch.randint(0, 128, (2, seq), generator=g)  # (batch, time): inputs and labels
    out: dict[str, Any] = {"rank": rank}
    if bucket != "default":  # with DeepSpeed's 2 GB buckets only the refusal is checked
        plain_engine, *_ = deepspeed.initialize(model=copy.deepcopy(base),
                                                config=config(stage, bucket), model_parameters=None)
        plain, out["plain_measured_steps"] = train(kind, plain_engine, ids)
    model = copy.deepcopy(base)
    cfg = {**config(stage, bucket), "memfit": {"budget": 0.6}}
    example = (ids, ids) if kind == "gpt" else {"input_ids": ids, "labels": ids}
    try:
        engine, *_ = memfit_ds.initialize(model=model, config=cfg, example_inputs=example,
                                          loss_fn=None if kind == "gpt" else (lambda o: o.loss),
                                          model_parameters=model.parameters())
    except InfeasibleBudget as e:
        out.update(infeasible=str(e), budget_bytes=e.budget_bytes, engine_bytes=e.min_feasible_bytes)
        finish(rank, out)
    if bucket == "default":
        out.update(infeasible="", budget_bytes=None, engine_bytes=None)  # planned: the test fails
        finish(rank, out)
    out["config_unchanged"] = cfg == {**config(stage, bucket), "memfit": {"budget": 0.6}}
    p = model.memfit_plan
    e = model.memfit_engine
    out.update(regions=[list(r.modules) for r in p.regions], budget_bytes=p.budget_bytes,
               predicted_peak_bytes=p.predicted_peak_bytes, plain_peak_bytes=p.plain_peak_bytes,
               engine_lines=[list(line) for line in e.lines], step_budget_bytes=e.budget_bytes,
               step_predicted_bytes=e.predicted_peak_bytes)
    initial = weights(engine)
    planned, out["measured_steps"] = train(kind, engine, ids)
    out["n_weights"] = len(plain)
    out["released_elements"] = sum(q.numel() for q in base.parameters() if q.numel() > 100)
    out["elements"] = sum(t.numel() for t in planned.values())
    out["unequal"] = sorted(n for n in plain if not torch.equal(plain[n], planned[n]))
    out["trained"] = sorted(n for n in initial if not torch.equal(initial[n], planned[n]))
    finish(rank, out)


def finish(rank: int, out: dict[str, Any]) -> None:
    Path(os.environ["MEMFIT_DIST_OUT"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
