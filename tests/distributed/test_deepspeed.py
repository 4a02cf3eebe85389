"""``memfit.integrations.deepspeed.initialize`` under DeepSpeed's engine, ZeRO stages 1-3, on 2
gloo ranks (``deepspeed_ranks.py``): weights after 3 AdamW steps bitwise equal to the same
engine without memfit, and the measured step peak below its. DeepSpeed is installed by
``./run`` into ``.venv/deepspeed`` (it builds against the installed torch:
``--no-build-isolation``), or importable from the environment."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.processes  # 2 ranks, each a process
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from launcher import launch  # noqa: E402  (this folder is on the path under pytest)

SITE = Path(sys.prefix) / "deepspeed"  # ./run's install target
if importlib.util.find_spec("deepspeed") is None and not (SITE / "deepspeed").is_dir():
    pytest.skip(f"DeepSpeed is not installed (./run setup puts it in {SITE})",
                allow_module_level=True)


def _launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> list[dict]:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return launch("deepspeed_ranks.py", *args, tmp_path=tmp_path)


# (stage, model, reduce_bucket_size, persistence): the zoo GPT at every stage with buckets a
# user sets (5e4 elements: 200,000 B, a sixth of the step's budget), the HF Llama at every stage
# (2e5: 800,000 B), ZeRO-3 on the Hugging Face models whose parameter gathers once raised a
# false RecomputeMismatch (NOTE [engine work in a region]), and ZeRO-3 with parameters over
# 100 elements released ("release": stage3_param_persistence_threshold 100).
CASES = [(1, "gpt", "5e4", ""), (2, "gpt", "5e4", ""), (3, "gpt", "5e4", ""),
         (3, "gpt", "5e4", "release"), (1, "llama", "2e5", ""), (2, "llama", "2e5", ""),
         (3, "llama", "2e5", ""), (3, "gpt2", "2e5", "")]


# ZeRO-3 with parameters released: the step's prediction counts the gathered parameters as a
# constant (NOTE [planning under a DeepSpeed engine], rule 9), which the forward's gathers and
# prefetch do not follow (docs/distributed.md, "Not counted yet"); what that leaves out depends on
# the plan, and which plan budget=0.6 picks depends on the profile's times (the machine's load).
# Measured on the zoo GPT's third step (2 ranks alike), measured / predicted by plan: 0.946,
# 0.988, 1.000, 1.006, 1.014, 1.052; the 1.006 and 1.052 plans peak in forward, at block 0's
# attention dropout inside a region (the 1.006 one 248,648 B above the timeline + the gathered
# parameters there), the others in backward. So the check is the budget, the prediction as a
# floor (less 10%) and a ceiling of the prediction plus the gathered parameters' line once more.


@pytest.mark.parametrize(("stage", "model", "bucket", "release"), CASES,
                         ids=[f"zero{s}-{m}-{b}{'-' + r if r else ''}" for s, m, b, r in CASES])
def test_zero_stage_weights_equal_the_engine_without_memfit(
        stage: int, model: str, bucket: str, release: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    results = _launch(monkeypatch, tmp_path, str(stage), model, bucket, *([release] if release else []))
    for res in results:
        assert res["regions"], "budget=0.6 planned no region"
        assert res["regions"] == results[0]["regions"]  # one plan per job
        assert res["config_unchanged"]
        assert len(res["trained"]) == res["n_weights"]  # every weight moved in 3 steps
        assert res["unequal"] == [], f"{len(res['unequal'])} parameters differ under ZeRO-{stage}"
        # the step's cap: 0.6 of the plain activation peak, holding activations + engine
        cap = res["step_budget_bytes"] if res["engine_lines"] else res["budget_bytes"]
        assert abs(cap - 0.6 * res["plain_peak_bytes"]) <= 1
        engine = sum(n for _, n in res["engine_lines"])
        if stage < 3:  # reduce_bucket_size elements of float32 (contiguous_gradients, no overlap_comm)
            assert res["engine_lines"] == [["reduce_bucket_size", 4 * int(float(bucket))]]
        elif release:  # every float32 parameter over 100 elements, gathered whole
            assert res["engine_lines"] == [["stage3_max_live_parameters",
                                            4 * res["released_elements"]]]
        else:
            assert res["engine_lines"] == []
        if engine:
            assert res["budget_bytes"] <= cap - engine  # the activations' share
        # the step's prediction: the plan's timeline with the gradients moved into the
        # engine's buffers (NOTE [DeepSpeed's gradients in the timeline]); within the
        # upper bound that adds them, and the cap
        predicted = res["step_predicted_bytes"]
        assert predicted <= res["predicted_peak_bytes"] + engine
        assert predicted <= cap
        # measured forward + backward (the CPU allocator), third step: within 3% of the
        # prediction, both ways (released parameters: above), and of the budget; seen in
        # docs/distributed.md's table
        measured, plain = res["measured_steps"][-1], res["plain_measured_steps"][-1]
        if release:
            assert 0.90 * predicted <= measured <= predicted + engine, (res["measured_steps"], predicted)
        else:
            assert 0.97 <= measured / predicted <= 1.03, (res["measured_steps"], predicted)
        assert measured <= 1.03 * cap
        assert measured < plain


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_default_buckets_alone_exceed_the_budget(stage: int, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's default reduce_bucket_size (5e8 float32 elements: 2 GB) under ZeRO-1 and 2
    and a budget of a few MB: InfeasibleBudget naming the bucket, on every rank."""
    results = _launch(monkeypatch, tmp_path, str(stage), "llama", "default")
    for res in results:
        assert "reduce_bucket_size" in res["infeasible"]
        assert res["engine_bytes"] == 4 * 500_000_000
        assert res["budget_bytes"] == results[0]["budget_bytes"] < res["engine_bytes"]
