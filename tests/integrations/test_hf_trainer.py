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
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
                              per_device_train_batch_size=BATCH, dataloader_num_workers=0,
                              seed=0, learning_rate=1e-2, save_strategy="no",
                              logging_strategy="no", disable_tqdm=True, **args)
    Trainer(model=model, args=targs, train_dataset=_dataset(), callbacks=callbacks).train()
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
