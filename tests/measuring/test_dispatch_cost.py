"""The fixed charges measured on this machine (NOTE [measured dispatch charges] in
``memfit.measuring.dispatch_cost``) and how the calibration uses them (NOTE [calibration cost] in
``memfit.measuring.calibration``). No test asserts a speed: the measured values only have to be
plausible, and what is derived from them is checked exactly."""

from __future__ import annotations

import torch

from memfit.measuring.calibration import profile as calibrated_profile
from memfit.measuring.dispatch_cost import (
    _PLAUSIBLE,
    DispatchCharges,
    _checked,
    measure_dispatch_charges,
)
from memfit.timemodel.calibration import (
    DEFAULT_KEEP_S_PER_ELEMENT,
    DEFAULT_OP_S,
    DEFAULT_REGION_S,
    DEFAULT_SELECTIVE_OP_S,
)


def test_every_charge_is_measured_on_cpu_or_kept_at_its_default_saying_why() -> None:
    """Each of the four charges is measured and plausible, or (timing noise on a busy machine:
    NOTE [measured dispatch charges]) its default with the reason; which of the two depends on
    the machine's load, so both pass."""
    c = measure_dispatch_charges("cpu")
    defaults = {"region_s": DEFAULT_REGION_S, "op_s": DEFAULT_OP_S,
                "selective_op_s": DEFAULT_SELECTIVE_OP_S, "keep_s_per_element": DEFAULT_KEEP_S_PER_ELEMENT}
    assert set(c.measured) <= set(defaults)
    for name, default in defaults.items():
        value = getattr(c, name)
        if name in c.measured:
            assert 0.0 <= value <= _PLAUSIBLE * default, (name, value)
        else:
            assert value == default and f"{name} " in c.reason, (name, c.reason)
    assert measure_dispatch_charges("cpu") is c  # once per process and device


def test_no_measurement_off_the_cpu() -> None:
    c = measure_dispatch_charges("meta")
    assert c == DispatchCharges(reason="not measured on meta: host work overlaps the device's")
    assert (c.region_s, c.op_s, c.selective_op_s) == (DEFAULT_REGION_S, DEFAULT_OP_S, DEFAULT_SELECTIVE_OP_S)


def test_implausible_charges_keep_their_defaults_and_say_so() -> None:
    c = _checked(region=-1e-4, op=2e-5, sel=1.0)
    assert c.measured == ("op_s",)
    assert _checked(region=1e-4, op=2e-5, sel=3e-5, keep=1e-9).keep_s_per_element == 1e-9
    assert _checked(region=1e-4, op=2e-5, sel=3e-5, keep=1.0).measured == ("region_s", "op_s", "selective_op_s")
    assert (c.region_s, c.op_s, c.selective_op_s) == (DEFAULT_REGION_S, 2e-5, DEFAULT_SELECTIVE_OP_S)
    assert c.reason == ("implausible (timing noise?), defaults kept: region_s -100.0 us, "
                        "selective_op_s 1000000.0 us")


def test_calibration_holds_the_measured_charges_and_the_interleaved_plain_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                                      torch.nn.Linear(64, 32)) for _ in range(4)))
    prof = calibrated_profile(model, torch.randn(16, 32), rounds=3)
    cal = prof.calibration
    charges = measure_dispatch_charges("cpu")
    assert cal is not None and cal.charges_measured == charges.measured
    held = {"region_s": charges.region_s, "op_s": charges.op_s, "selective_op_s": charges.selective_op_s,
            "keep_s_per_element": charges.keep_s_per_element}
    for name, value in held.items():
        if name not in cal.fitted:  # the fit holds what it does not determine
            assert getattr(cal, name) == value, name
    # the plain step is the median of the two interleaved plain steps (round 0 warms up)
    traced = prof.extra["traced_step_time_s"]
    assert prof.step_time_s > 0 and traced > 0
    for m in cal.measurements:
        assert m.extra_s == m.step_s - prof.step_time_s
