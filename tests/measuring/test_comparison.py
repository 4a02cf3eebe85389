"""verify's comparison of a planned step with the plain step: bitwise on CPU or with
deterministic algorithms, else within the plain step's run-to-run spread (NOTE [comparison
modes] in ``memfit.measuring.comparison``). The spread mode is forced here on CPU, with the second plain
run perturbed by hand where a GPU's atomics would have perturbed it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit import zoo
from memfit.measuring.comparison import (
    SPREAD_FACTOR,
    SPREAD_FLOOR_ULPS,
    Comparison,
    compare_steps,
    comparison_for,
)
from memfit.measuring.twins import StepResult
from memfit.measuring.verification import verify
from memfit.planning.plan import Plan, Region
from memfit.planning.simulate import simulate
from memfit.profiling.tracer import trace
from memfit.runtime.apply import apply_plan

BITWISE, SPREAD = Comparison.BITWISE, Comparison.WITHIN_PLAIN_SPREAD


# ---- which comparison -----------------------------------------------------------------------
@pytest.mark.parametrize(("device", "deterministic", "expected"), [
    ("cpu", False, BITWISE),
    ("cpu", True, BITWISE),
    (torch.device("cpu"), False, BITWISE),
    ("cuda", True, BITWISE),
    ("cuda:1", True, BITWISE),
    ("cuda", False, SPREAD),
    (torch.device("cuda", 0), False, SPREAD),
    ("xpu", False, SPREAD),
], ids=["cpu", "cpu-deterministic", "cpu-device", "cuda-deterministic", "cuda1-deterministic", "cuda",
        "cuda0-device", "xpu"])
def test_comparison_for_device_and_determinism(device, deterministic, expected):
    assert comparison_for(device, deterministic) is expected


@pytest.mark.parametrize(("flag", "warn_only", "expected"), [
    (False, False, SPREAD),
    (True, False, BITWISE),
    (True, True, SPREAD),  # warn_only still runs the nondeterministic kernels
], ids=["off", "on", "warn-only"])
def test_comparison_for_reads_torchs_determinism_flag(flag, warn_only, expected):
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(flag, warn_only=warn_only)
        assert comparison_for("cuda") is expected
        assert comparison_for("cpu") is BITWISE
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ---- the spread comparison on hand-made step results ---------------------------------------
def _result(w: list[float], b: list[float], count: int = 1) -> StepResult:
    """A step that left gradients ``w.grad`` and ``b.grad``, a float and an integer buffer."""
    return StepResult(loss=torch.tensor(3.0), outputs=[torch.tensor([0.5, -0.25])],
                      param_grads={"w": torch.tensor(w), "b": torch.tensor(b)},
                      buffers={"running_mean": torch.tensor([0.1, 0.2]), "num_batches_tracked": torch.tensor(count)},
                      rng_after=torch.zeros(4, dtype=torch.uint8))


PLAIN = ([1.0, 2.0, 4.0], [1.0, -8.0])
# the second plain run: w differs by 2**-10 (its spread), b is the same (spread 0: the floor)
PLAIN_2 = ([1.0, 2.0 + 2**-10, 4.0], [1.0, -8.0])
B_FLOOR = SPREAD_FLOOR_ULPS * 2**-23 * 8.0  # 4 float32 ulps of b's largest magnitude: 2**-18


def test_spread_constants_are_the_stated_ones():
    assert (SPREAD_FACTOR, SPREAD_FLOOR_ULPS) == (4.0, 4)  # NOTE [comparison modes]
    assert B_FLOOR == 2**-18


@pytest.mark.parametrize(("planned", "passes"), [
    (([1.0, 2.0 + 2**-9, 4.0], PLAIN[1]), True),        # 2**-9 <= 4 x 2**-10
    (([1.0, 2.0, 4.0 + 2**-8], PLAIN[1]), True),        # exactly 4 x the spread
    (([1.0, 2.0, 4.0 + 2**-7], PLAIN[1]), False),       # 8 x the spread
    ((PLAIN[0], [1.0 + 2**-20, -8.0]), True),           # spread 0, within the floor 2**-18
    ((PLAIN[0], [1.0 + 2**-16, -8.0]), False),          # spread 0, 4 x the floor
], ids=["w-within-spread", "w-at-4x-spread", "w-beyond-spread", "b-within-floor", "b-beyond-floor"])
def test_a_gradient_passes_within_the_plain_spread_and_fails_beyond_it(planned, passes):
    got, ref, ref2 = _result(*planned), _result(*PLAIN), _result(*PLAIN_2)
    checks, total, bn_ok = compare_steps(got, ref, SPREAD, ref2)
    grads = next(c for c in checks if c.name == "parameter gradients")
    assert grads.passed is passes, grads.detail
    assert not total.bitwise  # one gradient differs in every case
    assert all(c.passed for c in checks if c.name != "parameter gradients") and bn_ok
    if passes:
        assert "2 tensors within the plain step's spread, 1 bitwise equal" in grads.detail
    else:
        bad = "w.grad" if planned[1] == PLAIN[1] else "b.grad"
        assert grads.detail.startswith(f"{bad} differs from the plain step"), grads.detail
        assert ", more than " in grads.detail and "x its plain run-to-run spread" in grads.detail
    # compared bitwise, the same gradients fail whatever their size
    bit = next(c for c in compare_steps(got, ref, BITWISE)[0] if c.name == "parameter gradients")
    assert not bit.passed and "need bitwise equality" in bit.detail


def test_equal_tensors_stay_bitwise_in_the_spread_mode():
    checks, total, bn_ok = compare_steps(_result(*PLAIN), _result(*PLAIN), SPREAD, _result(*PLAIN_2))
    assert total.bitwise and total.max_abs == 0.0 and bn_ok
    assert all(c.passed for c in checks)
    assert next(c for c in checks if c.name == "parameter gradients").detail == "2 tensors bitwise equal"


@pytest.mark.parametrize(("field", "change", "check"), [
    ("buffers", {"running_mean": torch.tensor([0.1, 0.25])}, "buffers (BatchNorm statistics, masks)"),
    ("buffers", {"num_batches_tracked": torch.tensor(2)}, "buffers (BatchNorm statistics, masks)"),
    ("outputs", [torch.tensor([0.5, -0.5])], "outputs"),
    ("loss", torch.tensor(3.5), "loss"),
], ids=["float-buffer", "integer-buffer", "output", "loss"])
def test_buffers_outputs_and_loss_are_held_to_the_spread_too(field, change, check):
    got = _result(*PLAIN)
    value = {**got.buffers, **change} if field == "buffers" else change
    got = dataclasses.replace(got, **{field: value})
    checks, total, bn_ok = compare_steps(got, _result(*PLAIN), SPREAD, _result(*PLAIN_2))
    assert [c.name for c in checks if not c.passed] == [check]
    assert not total.bitwise and not total.close
    assert bn_ok is (field != "buffers")


def test_the_spread_mode_needs_the_second_plain_run():
    with pytest.raises(ValueError, match="needs a second plain run"):
        compare_steps(_result(*PLAIN), _result(*PLAIN), SPREAD)


# ---- verify says which comparison it made --------------------------------------------------
@pytest.fixture(scope="module")
def planned_gpt():
    model = zoo.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    x = zoo.example_inputs(model, batch=2)
    prof = trace(model, x, repeats=1)
    plan = Plan(regions=(Region(("blocks.0",)), Region(("blocks.1",))), predicted_peak_bytes=0, recompute_s=0.0,
                budget_bytes=None, solver="hand", profile_signature=prof.signature,
                plain_peak_bytes=prof.peak_bytes, plain_step_s=prof.step_time_s, model="GPT")
    plan = dataclasses.replace(plan, predicted_peak_bytes=simulate(prof, plan).peak_bytes)
    apply_plan(model, plan)
    return model, x


def test_verify_on_cpu_compares_bitwise_and_says_so(planned_gpt):
    report = verify(*planned_gpt)
    assert report.comparison == "bitwise" and report.to_dict()["comparison"] == "bitwise"
    assert str(report).startswith("memfit verify (hand, cpu, bitwise): PASSED")


def test_verify_forced_within_plain_spread_on_cpu_passes_bitwise_and_says_so(planned_gpt):
    report = verify(*planned_gpt, comparison="within plain spread")
    assert report.ok and report.bitwise and report.max_abs_diff == 0.0, str(report)  # CPU runs agree
    assert report.comparison == "within plain spread"
    assert str(report).startswith("memfit verify (hand, cpu, within plain spread): PASSED")


def _perturbing_record_step(monkeypatch, name: str, second_plain: float, planned: float) -> None:
    """verify's ``record_step`` with ``name``'s gradient moved by ``second_plain`` in the second
    plain run and by ``planned`` in the planned run (the third call), as atomics would."""
    import memfit.measuring.verification as verification

    real, calls = verification.record_step, []

    def record_step(step, **kw):
        result = real(step, **kw)
        calls.append(name)
        shift = {2: second_plain, 3: planned}.get(len(calls), 0.0)
        if shift:
            g = result.param_grads[name]
            assert g is not None
            result.param_grads[name] = g + shift * g.abs().max()
        return result

    monkeypatch.setattr(verification, "record_step", record_step)


@pytest.mark.parametrize(("planned", "passes"), [(2e-3, True), (1e-2, False)], ids=["within", "beyond"])
def test_verify_within_plain_spread_passes_a_gradient_within_it_and_names_one_beyond(
        planned_gpt, monkeypatch, planned, passes):
    name = "blocks.0.attn.qkv.weight"
    model, x = planned_gpt
    assert name in dict(model.named_parameters())
    _perturbing_record_step(monkeypatch, name, second_plain=1e-3, planned=planned)
    report = verify(model, x, comparison=SPREAD)
    assert report.comparison == "within plain spread" and not report.bitwise
    assert report.ok is passes, str(report)
    grads = next(c for c in report.checks if c.name == "parameter gradients")
    if passes:
        assert "within the plain step's spread" in grads.detail and f"tightest {name}.grad: " in grads.detail
    else:
        assert [c.name for c in report.failures] == ["parameter gradients"]
        assert grads.detail.startswith(f"{name}.grad differs from the plain step")
        assert "FAILED (1 of" in str(report) and "within plain spread" in str(report).splitlines()[0]


def test_verify_refuses_an_unknown_comparison(planned_gpt):
    with pytest.raises(ValueError, match="comparison must be one of .*'bitwise', 'within plain spread'.* got 'close'"):
        verify(*planned_gpt, comparison="close")


@pytest.mark.parametrize(("comparison", "records"), [(None, 2), (BITWISE, 2), (SPREAD, 3)],
                         ids=["default-on-cpu", "bitwise", "within-plain-spread"])
def test_verify_runs_the_plain_step_twice_only_to_compare_within_its_spread(
        planned_gpt, monkeypatch, comparison, records):
    import memfit.measuring.verification as verification

    real, calls = verification.record_step, []
    monkeypatch.setattr(verification, "record_step", lambda step, **kw: calls.append(1) or real(step, **kw))
    assert verify(*planned_gpt, comparison=comparison).ok
    assert len(calls) == records  # the plain step once or twice, then the planned step
