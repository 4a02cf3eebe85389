"""``memfit.integrations.deepspeed.fit_arguments``: DeepSpeed's config read into memfit.fit's
keywords (NOTE [planning under a DeepSpeed engine]); no DeepSpeed needed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.integrations import deepspeed as memfit_ds


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Linear(4, 4).to(dtype)


@pytest.mark.parametrize(("stage", "sharding"),
                         [(0, "none"), (1, "optimizer"), (2, "gradients"), (3, "full")])
def test_device_memory_plans_the_zero_stages_sharding(stage: int, sharding: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW"},
           "memfit": {"device_memory": "80GiB", "reserve": "2GiB"}}
    # ZeRO-1/2: DeepSpeed's default gradient bucket, 5e8 float32 elements, a line of the job
    engine = (("reduce_bucket_size", 2_000_000_000),) if stage in (1, 2) else ()
    assert memfit_ds.fit_arguments(cfg, _model()) == {"job": memfit.Job(
        device="80GiB", reserve="2GiB", sharding=sharding, world_size=8, optimizer="adamw",
        engine=engine)}


@pytest.mark.parametrize(("zero", "expected"), [
    ({"stage": 1}, (("reduce_bucket_size", 2_000_000_000),)),  # DeepSpeed's default 5e8
    ({"stage": 2, "reduce_bucket_size": 1000}, (("reduce_bucket_size", 4000),)),
    ({"stage": 2, "reduce_bucket_size": 1e3, "overlap_comm": True},
     (("reduce_bucket_size x2 (overlap_comm)", 8000),)),
    ({"stage": 1, "contiguous_gradients": False}, ()),
    ({"stage": 3, "reduce_bucket_size": 1000}, ()),  # 16 + 4 elements: under 1e5, persistent
    # the 16-element weight is over the threshold: gathered whole, float32
    ({"stage": 3, "stage3_param_persistence_threshold": 10}, (("stage3_max_live_parameters", 64),)),
    ({"stage": 3, "stage3_param_persistence_threshold": 0}, (("stage3_max_live_parameters", 80),)),
    ({"stage": 0}, ()),
], ids=["zero1-default", "zero2-set", "overlap", "not-contiguous", "zero3", "zero3-released",
        "zero3-all-released", "zero0"])
def test_engine_memory_counts_the_gradient_bucket(zero: dict, expected: tuple) -> None:
    assert memfit_ds.engine_memory({"zero_optimization": zero}, _model()) == expected
    half = memfit_ds.engine_memory({"zero_optimization": zero}, _model(torch.bfloat16))
    assert half == tuple((name, n // 2) for name, n in expected)  # 2-byte gradients


def test_bf16_plans_fp32_master_weights_and_states(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}
    args = memfit_ds.fit_arguments(cfg, _model(torch.bfloat16), device_memory=1 << 30)
    assert args == {"job": memfit.Job(device=1 << 30, sharding="none", world_size=2,
                                      optimizer="sgd-momentum", master_weights=True,
                                      state_dtype=torch.float32)}


def test_a_budget_alone_passes_through() -> None:
    assert memfit_ds.fit_arguments({"memfit": {"budget": 0.6, "solver": "chain"}}, _model()) == \
        {"budget": 0.6, "search": memfit.Search(solver="chain")}
    assert memfit_ds.fit_arguments({}, _model(), budget="6GiB") == {"budget": "6GiB"}


def test_an_optimizer_instance_is_planned_as_given() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    args = memfit_ds.fit_arguments({}, model, device_memory="1GiB", optimizer=opt)
    assert args["job"].optimizer is opt


@pytest.mark.parametrize(("cfg", "kwargs", "message"), [
    ({}, {}, r"no memory budget: put \{\"memfit\": \{\"budget\": 0.6\}\}"),
    ({"memfit": {"budgt": 0.5}}, {}, r"unknown key\(s\) \['budgt'\] in the config's \"memfit\""),
    ({"memfit": {"budget": 0.5}}, {"budget": 0.4}, r"\['budget'\] given both"),
    ({"memfit": []}, {}, r"must be a dict of memfit.fit keywords, got list"),
    ({"fp16": {"enabled": True}, "memfit": {"budget": 0.5}}, {},
     r"enables torch.float16 training.*cast it first \(model.to\(torch.float16\)\)"),
    ({"optimizer": {"type": "Lamb"}}, {"device_memory": "1GiB"},
     r"knows DeepSpeed optimizers \['adam', 'adamw', 'sgd'\], got 'Lamb'"),
    ({"zero_optimization": {"stage": 4}}, {"device_memory": "1GiB"}, r"stage must be 0-3, got 4"),
    ({"memfit": {"budget": 0.5, "reserve": "2GiB"}}, {},
     r"\['reserve'\] in the config's \"memfit\" block count against device_memory"),
])
def test_bad_configs_are_refused_with_what_to_do(cfg: dict, kwargs: dict, message: str) -> None:
    before = repr(cfg)
    with pytest.raises((ValueError, TypeError), match=message):
        memfit_ds.fit_arguments(cfg, _model(), **kwargs)
    assert repr(cfg) == before  # nothing the caller passed is changed


def test_a_partitioned_model_is_refused() -> None:
    model = _model()
    model.weight.ds_id = 0  # what deepspeed.zero.Init leaves on each parameter
    with pytest.raises(ValueError, match=r"already partitioned by DeepSpeed .*zero.Init"):
        memfit_ds.fit_arguments({}, model, budget=0.5)


def test_initialize_without_deepspeed_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ImportError, match=r"needs DeepSpeed: pip install --no-build-isolation"):
        memfit_ds.initialize(model=_model(), config={}, budget=0.5)


class _PartitionAfterPlan:
    """A timeline whose step adds ``extra`` bytes to the plan's peak + buffers (as ZeRO-2's
    gradient partition can, NOTE [DeepSpeed's gradients in the timeline])."""

    def __init__(self, buffers: int, extra: int) -> None:
        self.buffers, self.extra, self.seen = buffers, extra, []

    def peak(self, plan: memfit.Plan) -> int:
        self.seen.append(plan.budget_bytes)
        return plan.predicted_peak_bytes + self.buffers + self.extra


def test_a_step_over_the_budget_is_planned_again_for_less() -> None:
    """Fake mode (a model on the meta device): the same profile and plans on any machine."""
    with torch.device("meta"):
        model = memfit.zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=64, vocab_size=128, seed=0)
    x = torch.zeros(2, 64, dtype=torch.long, device="meta")
    prof = memfit.profile(model, (x, x), mode="fake")
    cap, bucket = prof.peak_bytes // 2, 20_000
    first = memfit.plan(prof, budget=cap - bucket)
    # the partition takes the first plan's step 1 B over the budget
    extra = cap - bucket - first.predicted_peak_bytes + 1
    timeline = _PartitionAfterPlan(bucket, extra)
    memfit_ds._fit_with_engine(model, (("reduce_bucket_size", bucket),), (x, x), None, None,
                               {"budget": cap}, timeline)  # type: ignore[arg-type]
    engine = model.memfit_engine
    assert engine.budget_bytes == cap
    assert timeline.seen[0] == cap - bucket  # first: the budget less the bucket
    assert len(timeline.seen) >= 2 and timeline.seen[1] <= cap - bucket - 1  # then for less
    assert engine.predicted_peak_bytes == timeline.peak(model.memfit_plan) <= cap
