"""MemfitCallback in a transformers Trainer: planned on the first batch, bitwise the same run."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from hf_models import BATCH, SEQ, VOCAB, assert_same_weights, llama

pytestmark = pytest.mark.hf


def _dataset(n: int = 4 * BATCH) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)  # (time,)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _train(tmp_path, callbacks, **args) -> torch.nn.Module:
    from transformers import Trainer, TrainingArguments

    model = llama()
    settings = {"logging_strategy": "no", **args}
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
                              per_device_train_batch_size=BATCH, dataloader_num_workers=0,
                              seed=0, learning_rate=1e-2, save_strategy="no",
                              disable_tqdm=True, **settings)
    trainer = Trainer(model=model, args=targs, train_dataset=_dataset(), callbacks=callbacks)
    trainer.train()
    model.trainer_state = trainer.state
    return model


def test_trainer_with_callback_trains_bitwise(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    plain = _train(tmp_path / "plain", [])
    ours = _train(tmp_path / "memfit", [MemfitCallback(budget=0.5)])
    plan = ours.memfit_plan
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes == int(0.5 * plan.plain_peak_bytes)
    assert_same_weights(ours, plain)
    assert any(not torch.equal(p, q) for p, q in zip(plain.parameters(), llama().parameters(),
                                                       strict=True))  # it did train


def test_trainer_logs_carry_the_monitor_records(tmp_path):
    from memfit.integrations.hf import MemfitCallback

    ours = _train(tmp_path, [MemfitCallback(budget=0.5, monitor_every=2)],
                  logging_strategy="steps", logging_steps=1)
    from memfit._torch import profiler_active

    assert not profiler_active()  # the last step's CPU meter ended with the training
    records = list(ours.memfit_monitor)
    assert [r.step for r in records] == [0, 2]
    logged = {e["step"]: e for e in ours.trainer_state.log_history if "loss" in e}
    assert sorted(logged) == [1, 2, 3]
    # a record is logged once, at the first log after its step: steps 1 and 3 (none at 2)
    assert "memfit/peak_bytes" not in logged[2]
    for step, rec in ((1, records[0]), (3, records[1])):
        assert logged[step]["memfit/peak_bytes"] == rec.peak_bytes  # int bytes, exact
        assert logged[step]["memfit/step_s"] == rec.step_s
        assert logged[step]["memfit/recompute_overhead"] == ours.memfit_plan.overhead > 0


def test_trainer_callback_takes_over_gradient_checkpointing(tmp_path, caplog):
    from memfit.integrations.hf import MemfitCallback

    plain = _train(tmp_path / "plain", [])
    with caplog.at_level(logging.WARNING, logger="memfit"):
        ours = _train(tmp_path / "memfit", [MemfitCallback(budget=0.5, solver="chain")],
                      gradient_checkpointing=True)
    assert any("checkpointing=True) and MemfitCallback both checkpoint" in r.getMessage()
               for r in caplog.records)
    assert not ours.is_activation_checkpointing and ours.memfit_plan.regions
    assert_same_weights(ours, plain)


@pytest.mark.processes
def test_importing_the_integration_does_not_import_transformers():
    code = ("import sys, memfit, memfit.integrations.hf as hf\n"
            "assert 'transformers' not in sys.modules, 'imported early'\n"
            "import transformers\n"
            "assert issubclass(hf.MemfitCallback, transformers.TrainerCallback)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _pad_to_longest(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as ``DataCollatorForLanguageModeling(tok, mlm=False)`` does it: each
    batch right-padded to its longest row (pad id 0, mask 0, labels -100)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)        # (batch, time)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = r["input_ids"], 1, r["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


PADDED_STEPS, LONGEST = 20, 128


def _ragged_rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(16, LONGEST + 1, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (k,), generator=g)} for k in lengths]


def _train_padded(tmp_path, callbacks) -> tuple[torch.nn.Module, object]:
    from transformers import Trainer, TrainingArguments

    model = llama(max_positions=LONGEST)
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=PADDED_STEPS, report_to=[],
                              use_cpu=True, per_device_train_batch_size=BATCH,
                              dataloader_num_workers=0, seed=0, learning_rate=1e-2,
                              save_strategy="no", logging_strategy="steps", logging_steps=5,
                              disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=_ragged_rows(PADDED_STEPS * BATCH),
                      data_collator=_pad_to_longest, callbacks=callbacks)
    trainer.train()
    return model, trainer


@pytest.mark.slow  # two 20-step Trainer runs, one monitored at every step
def test_trainer_with_dynamic_padding_keeps_the_budget_at_every_length(tmp_path, recwarn):
    from memfit.integrations.hf import MemfitCallback
    from memfit.runtime.apply import input_guard

    plain, _ = _train_padded(tmp_path / "plain", [])
    # budget: half the plain peak of the 128-token step (max_length=128 is the plan's example)
    callback = MemfitCallback(budget=0.5, max_length=LONGEST, monitor_every=1)
    ours, trainer = _train_padded(tmp_path / "memfit", [callback])
    plan, guard = ours.memfit_plan, input_guard(ours)
    budget = plan.budget_bytes
    checked = plan.extra["shapes"]
    assert budget == checked["budget_bytes"] == int(0.5 * plan.plain_peak_bytes)
    # planned up front at lengths 1, 64 and 128; no re-plan during the run
    profiled = {int(k.split("input_ids=4x")[1].split(":")[0]): v
                for k, v in checked["predicted_peak_bytes"].items()}
    print(f"budget {budget}, predicted peak per profiled length {profiled}")
    assert sorted(profiled) == [1, 64, LONGEST] and checked["one_plan"]
    assert guard.replans == 0
    records = list(ours.memfit_monitor)
    assert [r.step for r in records] == list(range(PADDED_STEPS))
    lengths = [dict((n, s) for n, s, _ in r.shape)["input_ids"][1] for r in records]
    assert len(set(lengths)) > 5  # it did pad to many lengths
    for r, n in zip(records, lengths, strict=True):
        print(f"seq {n:4d}: peak {r.peak_bytes} <= budget {budget} "
              f"({r.peak_bytes / budget:.3f}), predicted {r.predicted_peak_bytes}")
        assert r.peak_bytes <= 1.03 * budget, n
    print(f"re-plans {guard.replans}, switches {guard.switches}, one plan {checked['one_plan']}")
    assert_same_weights(ours, plain)
    # the 128-token plan predicts a bound for shorter lengths: no drift warning
    assert not [w for w in recwarn if "memfit monitor" in str(w.message)]
    # NOTE [planning for dynamic padding]: the logs carry the monitor's records
    logged = [e for e in trainer.state.log_history if "memfit/peak_bytes" in e]
    assert [e["step"] for e in logged] == [5, 10, 15, 20]
    for e in logged:
        rec = records[e["step"] - 1]
        assert e["memfit/peak_bytes"] == rec.peak_bytes and e["memfit/step_s"] == rec.step_s
        assert e["memfit/recompute_overhead"] == ours.memfit_plan.overhead
