"""``memfit.Job``: the job on its device as one value (NOTE [a job's device]), and the old job
keywords it replaces (NOTE [the old job keywords]): the same plans, with a warning."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import memfit
from memfit import zoo
from memfit.job.device_memory import Job
from memfit.planning.job import OptimizerMemory


@pytest.mark.parametrize(("device", "expected"), [
    ("h100", 80_000_000_000),       # the preset's datasheet figure, decimal GB
    (" H200 ", 141_000_000_000),    # any case, spaces stripped
    ("a100", 80_000_000_000),
    ("v100", 16 * 2**30),
    ("80GiB", 80 * 2**30),
    ("141GB", 141_000_000_000),
    (1 << 20, 1 << 20),
], ids=["h100", "h200-any-case", "a100", "v100", "GiB", "GB", "bytes"])
def test_a_device_is_a_preset_or_bytes_or_a_size(device, expected):
    assert Job(device=device).device_memory_bytes == expected


BAD = {
    "cpu-preset": ({"device": "cpu"}, ValueError, "names the cpu preset, which has no memory size"),
    "no-size": ({"device": "lots"}, ValueError,
                "cannot parse device='lots'.*or name a device preset: \\['a100', 'h100', 'h200', 'v100'\\]"),
    "zero": ({"device": 0}, ValueError, "device must be positive bytes, got 0"),
    "bool": ({"device": True}, TypeError, "device must be int bytes .* got bool True"),
    "optimizer-name": ({"device": "1GiB", "optimizer": "lamb"}, ValueError,
                       "unknown optimizer 'lamb'; name one of \\['adam', 'adamw', 'sgd', 'sgd-momentum'\\]"),
    "optimizer-type": ({"device": "1GiB", "optimizer": 3}, TypeError,
                       "optimizer must be a torch.optim.Optimizer, .* got int"),
    "own-count-and-dtype": ({"device": "1GiB", "optimizer": OptimizerMemory("mine", 8, 0),
                             "state_dtype": "bf16"}, ValueError, "is a count of its own"),
    "state-dtype": ({"device": "1GiB", "state_dtype": "float99"}, ValueError,
                    "state_dtype: unknown dtype 'float99'"),
    "flag": ({"device": "1GiB", "master_weights": 1}, TypeError, "master_weights must be True or False, got 1"),
    "world": ({"device": "1GiB", "world_size": 2.5}, ValueError,
              "world_size must be a whole number of devices >= 1, got float 2.5"),
    "sharding": ({"device": "1GiB", "sharding": "zero3"}, ValueError,
                 "sharding must be one of \\('none', 'optimizer', 'gradients', 'full'\\).* got 'zero3'"),
    "reserve": ({"device": "1GiB", "reserve": -1}, ValueError, "reserve must be >= 0 bytes, got -1"),
}


@pytest.mark.parametrize(("options", "error", "message"), BAD.values(), ids=BAD.keys())
def test_a_job_is_checked_when_made(options, error, message):
    with pytest.raises(error, match=message):
        Job(**options)


def test_a_job_is_frozen_keyword_only_and_reads_as_written():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    job = Job(device="80GiB", optimizer=opt, world_size=8, sharding="full", reserve="2GiB")
    assert repr(job) == ("Job(device='80GiB', optimizer=<torch.optim.adamw.AdamW>, world_size=8, "
                         "sharding='full', reserve='2GiB')")
    assert str(job) == "a job on 80GiB: AdamW, full sharding over 8 devices, reserve 2GiB"
    assert repr(Job(device="h100", optimizer="adamw", state_dtype="bf16")) == \
        "Job(device='h100', optimizer='adamw', state_dtype='bf16')"
    assert str(Job(device="h100", master_weights=True, grad_accumulation=True)) == \
        "a job on h100 (74.51 GiB): no optimizer, fp32 master weights, gradient accumulation"
    assert Job(device=1 << 30) == Job(device=1 << 30) and hash(Job(device=1 << 30))
    with pytest.raises(dataclasses_frozen()):
        job.device = "40GiB"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Job("80GiB")  # type: ignore[misc]


def dataclasses_frozen() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.fixture(scope="module")
def tiny_profile() -> memfit.Profile:
    torch.manual_seed(0)
    return memfit.profile(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                              torch.nn.Linear(256, 32)), torch.randn(4, 64))


def test_the_old_keywords_warn_with_the_new_spelling_and_plan_the_same(tiny_profile):
    new = memfit.plan(tiny_profile, Job(device="64MiB", optimizer="adamw", state_dtype="bf16"))
    message = ("plan(device_memory=..., optimizer_state_dtype=..., optimizer=...) is deprecated: "
               "pass job=memfit.Job(device=..., optimizer=..., state_dtype=...)")
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as caught:
        old = memfit.plan(tiny_profile, device_memory="64MiB", optimizer_state_dtype="bf16",
                          optimizer="adamw")
    assert [w.filename for w in caught] == [__file__]  # it points at the caller
    assert old.memory == new.memory and old.memory is not None
    # two bf16 moments of 24,864 parameters, and a 4-byte step counter per tensor (4)
    assert old.memory.optimizer_bytes == 2 * 2 * 24_864 + 4 * 4 == 99_472
    assert (old.regions, old.predicted_peak_bytes) == (new.regions, new.predicted_peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns of nothing
        assert memfit.plan(tiny_profile, budget=Job(device="64MiB", optimizer="adamw",
                                                    state_dtype="bf16")).memory == new.memory


REFUSED = {
    "job-and-keywords": ({"job": Job(device="1GiB"), "optimizer": "adamw"},
                         r"plan\(\) got a Job and optimizer=\.\.\., which describe the job too"),
    "two-jobs": ({"job": Job(device="1GiB"), "budget": Job(device="2GiB")},
                 r"got a Job as budget= and job= too"),
    "not-a-job": ({"job": "80GiB"}, r"plan's job must be a memfit.Job .* got str '80GiB'"),
    "no-device": ({"budget": "50%", "optimizer": "adamw"},
                  r"optimizer describe the job on a device, .* give device_memory"),
    "unknown": ({"device_memroy": "1GiB"}, r"plan\(\) got an unexpected keyword argument 'device_memroy'"),
}


@pytest.mark.parametrize(("kwargs", "message"), REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_spellings_at_once_are_refused(tiny_profile, kwargs, message):
    with pytest.raises(TypeError, match=message):
        memfit.plan(tiny_profile, **kwargs)


def _meta(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = (zoo.gpt(n_layer=3, d_model=64, n_head=2, seq_len=64) if name == "gpt"
                 else zoo.resnet(blocks_per_stage=(1, 1), width=16))
    x = (torch.randint(0, 512, (4, 64)) if name == "gpt" else torch.randn(4, 3, 32, 32))
    return model, x


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_fit_plans_the_same_through_both_spellings(name):
    # fake mode on the meta device: the same profile each time, so any difference is the job's
    model, x = _meta(name)
    prof = memfit.profile(model, x, mode="fake", target="h100")
    least = memfit.plan(prof, budget="min").predicted_peak_bytes
    free = memfit.plan(prof, Job(device="1TiB", optimizer="adamw", world_size=2,
                                 sharding="optimizer", reserve=0)).memory
    assert free is not None
    # a device between the smallest plan's job and the plain step's: checkpointing binds
    device = free.total_bytes - free.activations_bytes + (least + prof.peak_bytes) // 2
    new_job = Job(device=device, optimizer="adamw", world_size=2, sharding="optimizer", reserve=0)
    new = memfit.fit(model, x, new_job, search=memfit.Search(target="h100")).memfit_plan
    memfit.unapply(model)
    with pytest.warns(DeprecationWarning, match=re.escape("fit(device_memory=..., optimizer=...")):
        old = memfit.fit(model, x, device_memory=device, optimizer="adamw", world_size=2,
                         sharding="optimizer", reserve=0, search=memfit.Search(target="h100")).memfit_plan
    memfit.unapply(model)
    assert new.regions and new.memory is not None and new.memory.fits
    assert new.memory.device_memory_bytes == device and new.memory.world_size == 2
    assert (old.regions, old.predicted_peak_bytes, old.memory) == (
        new.regions, new.predicted_peak_bytes, new.memory)
    assert new.predicted_peak_bytes < prof.peak_bytes  # a plan that checkpoints


@pytest.mark.slow
def test_a_fitted_job_re_plans_a_new_shape_for_the_same_device_and_pickles():
    import copy
    import io

    from memfit.runtime.apply import input_guard

    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=128, vocab_size=64)
    job = Job(device="48MiB", optimizer="adamw")
    memfit.fit(model, zoo.example_inputs(model, batch=4, size=64), job)
    first = model.memfit_plan
    model(zoo.example_inputs(model, batch=4, size=128)).sum().backward()  # re-planned in the call
    again = model.memfit_plan
    guard = input_guard(model)
    assert guard is not None and guard.replans == 1
    assert again.input_signature[0] == ("0", (4, 128), "int64")
    assert first.memory is not None and again.memory is not None
    assert again.memory.device_memory_bytes == first.memory.device_memory_bytes == 48 * 2**20
    assert again.memory.fits and again.memory.optimizer == first.memory.optimizer
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the re-planner holds the Job (NOTE [a fitted model pickles])
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert input_guard(loaded).replan.plan_profile.job == job
    assert input_guard(copy.deepcopy(model)).replan.plan_profile.job == job


@pytest.mark.slow
def test_largest_batch_finds_the_same_batch_through_both_spellings():
    model, _ = _meta("gpt")

    def make(n: int) -> tuple[torch.nn.Module, torch.Tensor]:
        return model, torch.randint(0, 512, (n, 64))

    job = Job(device="12MiB", optimizer="adamw", reserve=0)
    new = memfit.largest_batch(make, job, target="h100", limit=32)
    with pytest.warns(DeprecationWarning, match=re.escape(
            "largest_batch(device_memory=..., optimizer=..., reserve=...) is deprecated: pass "
            "job=memfit.Job(device=..., optimizer=..., reserve=...)")):
        old = memfit.largest_batch(make, target="h100", limit=32, device_memory="12MiB",
                                   optimizer="adamw", reserve=0)
    assert 1 < new.batch < 32  # the device bounds it, not the limit
    assert (old.batch, old.plan.regions, old.plan.memory) == (new.batch, new.plan.regions, new.plan.memory)
    assert [(p.n, p.smallest_total_bytes) for p in old.probes] == [
        (p.n, p.smallest_total_bytes) for p in new.probes]
    with pytest.raises(TypeError, match=r"largest_batch needs the device to search for"):
        memfit.largest_batch(make)
