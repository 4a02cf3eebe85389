"""MemfitCallback: a Lightning run with a budget is bitwise the run without it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from memfit import zoo

lightning = pytest.importorskip("lightning")

from memfit.integrations.lightning import MemfitCallback  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_determinism():
    """Trainer(deterministic=True) turns torch's deterministic algorithms on for the whole
    process; later tests (CPU convolution workspaces) must not inherit that."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(on, warn_only=warn)


class GPTModule(lightning.LightningModule):
    """A zoo GPT (dropout on) trained on next-token prediction; logs its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = zoo.gpt(n_layer=3, d_model=32, n_head=2, seq_len=32, vocab_size=64,
                             dropout=0.1)

    def training_step(self, batch, batch_idx):
        (ids,) = batch                                  # (batch, time) token ids
        loss = self.model(ids[:, :-1], ids[:, 1:].contiguous())
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _train(callbacks, precision="32-true"):
    lightning.seed_everything(0, verbose=False)
    module = GPTModule()
    ids = torch.randint(0, 64, (16, 33))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4,
                                         shuffle=True)
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, deterministic=True,
                                precision=precision, callbacks=callbacks)
    trainer.fit(module, loader)
    return module, trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_callback_run_is_bitwise_the_plain_run(precision):
    # bf16-mixed: the step is profiled under the precision plugin's autocast, as it trains
    plain, plain_trainer = _train([], precision)
    callback = MemfitCallback(budget=0.6)
    planned, trainer = _train([callback], precision)
    plan = planned.memfit_plan
    assert callback.plan is plan and plan.regions
    assert all(r.modules[0].startswith("model.blocks.") for r in plan.regions)
    assert plan.predicted_peak_bytes <= plan.budget_bytes == int(0.6 * plan.plain_peak_bytes)
    for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    # logged values (per step and the epoch mean) are those of the plain run
    assert trainer.callback_metrics.keys() == plain_trainer.callback_metrics.keys()
    for key, value in plain_trainer.callback_metrics.items():
        assert torch.equal(trainer.callback_metrics[key], value), key
    assert "log" not in planned.__dict__ and "log_dict" not in planned.__dict__


class ManualModule(GPTModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_callback_refuses_manual_optimization():
    trainer = lightning.Trainer(max_steps=1, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[MemfitCallback(budget=0.6)])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 64, (4, 33))), batch_size=4)
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(ManualModule(), loader)


@pytest.mark.processes
def test_module_imports_without_lightning():
    code = ("import sys; sys.modules['lightning'] = None\n"
            "import memfit.integrations.lightning as m\n"
            "try:\n    m.MemfitCallback\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs Lightning" in out.stdout and "memfit[lightning]" in out.stdout


def test_callback_profiles_under_the_precision_plugins_autocast():
    plans = {}
    for precision in ("32-true", "bf16-mixed"):
        callback = MemfitCallback(budget=0.6)
        _train([callback], precision)
        plans[precision] = callback.plan
    full, mixed = plans["32-true"], plans["bf16-mixed"]
    # autocast casts the weights (ops of their own, in the signature) and halves what matmuls
    # save: a profile of the fp32 step would give the fp32 plan's signature and peak
    assert mixed.profile_signature != full.profile_signature
    assert mixed.plain_peak_bytes < full.plain_peak_bytes


def _pad_to_longest(rows):
    """Each batch right-padded with token 0 to its longest row: (batch, time) token ids."""
    n = max(len(r) for (r,) in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    for i, (r,) in enumerate(rows):
        ids[i, :len(r)] = r
    return [ids]


RAGGED_STEPS, LONGEST = 6, 33  # rows of 9..33 tokens: the GPT sees 8..32 positions


def _train_ragged(callbacks, logger=False):
    lightning.seed_everything(0, verbose=False)
    module = GPTModule()
    g = torch.Generator().manual_seed(3)
    rows = [(torch.randint(0, 64, (int(n),), generator=g),)
            for n in torch.randint(9, LONGEST + 1, (4 * RAGGED_STEPS,), generator=g)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True,
                                         collate_fn=_pad_to_longest)
    trainer = lightning.Trainer(max_steps=RAGGED_STEPS, accelerator="cpu", logger=logger,
                                log_every_n_steps=1, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                deterministic=True, callbacks=callbacks)
    trainer.fit(module, loader)
    return module


def test_callback_with_max_length_keeps_the_budget_at_every_length(tmp_path, recwarn):
    import csv

    plain = _train_ragged([])
    callback = MemfitCallback(budget=0.6, max_length=LONGEST, monitor_every=1)
    logger = lightning.pytorch.loggers.CSVLogger(str(tmp_path), name="run", version=0)
    planned = _train_ragged([callback], logger)
    from memfit._torch import profiler_active

    assert not profiler_active()  # the last step's CPU meter ended with the training
    plan, budget = planned.memfit_plan, planned.memfit_plan.budget_bytes
    assert plan.regions and budget == int(0.6 * plan.plain_peak_bytes)  # of the 33-token step
    records = list(planned.memfit_monitor)
    assert [r.step for r in records] == list(range(RAGGED_STEPS))
    lengths = [r.shape[0][1][1] for r in records]
    assert len(set(lengths)) > 2 and max(lengths) <= LONGEST
    for r, n in zip(records, lengths, strict=True):
        print(f"seq {n}: peak {r.peak_bytes} <= budget {budget} ({r.peak_bytes / budget:.3f})")
        assert r.peak_bytes <= 1.03 * budget, n
    for (name, p), q in zip(planned.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    # the prediction is the 33-token step's: shorter steps are not drifting from it
    assert not [w for w in recwarn if "memfit monitor" in str(w.message)]
    # the logger got each step's record, peak_bytes to the byte
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("memfit/peak_bytes")]
    assert [int(row["step"]) for row in rows] == list(range(RAGGED_STEPS))
    for row, r in zip(rows, records, strict=True):
        assert int(float(row["memfit/peak_bytes"])) == r.peak_bytes
        assert float(row["memfit/step_s"]) == pytest.approx(r.step_s, rel=1e-12)  # csv repr
        assert float(row["memfit/recompute_overhead"]) == pytest.approx(plan.overhead, rel=1e-12)
