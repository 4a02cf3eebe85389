"""What a plan's recompute costs over a training run: FLOPs, GPU-hours, energy, money.

``Plan.cost(steps, gpus, ...)`` returns a :class:`RunCost`: the plan's extra FLOPs and
seconds per step, and for ``steps`` steps on ``gpus`` devices of a target preset the extra
device-hours, the energy they draw at the board's power, and with a price their cost.

NOTE [run cost]
    1. The extra seconds per step are ``Plan.recompute_s``: the recompute the plan adds to one
       step on one device, in the times of the device the profile was made for (its fake-mode
       target, or the device it ran on). Every device of a data-parallel run recomputes its
       own micro-batch, so the run's extra device-hours are ``recompute_s * steps * gpus /
       3600``.
    2. The times are only as good as the target they were made for: a plan profiled for an
       H100 has H100 seconds, and charging them to an A100 would be wrong by the ratio of the
       two. ``cost`` therefore refuses a ``target`` other than the profile's, and says how to
       profile for it; a profile measured on a GPU no preset names (``"cuda:0"``) is taken as
       the ``target`` the caller names, and the figure says so.
    3. Energy is ``device-hours * board_power_w / 1000`` kWh: every extra second is charged at
       the board's datasheet power (NOTE [board power] in ``memfit.timemodel.devices``), an
       assumption the figure states and ``board_power_w`` overrides. The CPU preset has no
       board power: a CPU run needs ``board_power_w``.
    4. Extra FLOPs are per step per device (``Plan.extra_flops``, NOTE [plan schema]); over
       the run they are ``extra_flops * steps * gpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Protocol

    class Plan(Protocol):  # what a run's cost reads of memfit.planning.plan.Plan
        @property
        def recompute_s(self) -> float: ...
        @property
        def extra_flops(self) -> int | None: ...
        @property
        def profile_device(self) -> str: ...

__all__ = ["RunCost", "run_cost"]


@dataclass(frozen=True)
class RunCost:
    """A plan's recompute over a run: per step, and over ``steps`` steps on ``gpus`` devices.

    Attributes:
        steps: training steps of the run.
        gpus: devices, each running the step (data parallel).
        target: the device preset the figures are for (``"h100"``).
        extra_flops_per_step: FLOPs the recompute adds to one step on one device; None for a
            plan made before memfit recorded them (plan again).
        extra_s_per_step: seconds the recompute adds to one step (``Plan.recompute_s``).
        extra_gpu_hours: ``extra_s_per_step * steps * gpus / 3600``.
        board_power_w: watts charged per device for every extra second (the assumption).
        extra_energy_kwh: ``extra_gpu_hours * board_power_w / 1000``.
        price_per_gpu_hour: the price given, per device-hour; None: none given.
        extra_cost: ``extra_gpu_hours * price_per_gpu_hour``; None without a price.
        power_source: where ``board_power_w`` comes from (a datasheet, or "given").
        times_from: the device the plan's seconds were profiled for.
    """

    steps: int
    gpus: int
    target: str
    extra_flops_per_step: int | None
    extra_s_per_step: float
    extra_gpu_hours: float
    board_power_w: float
    extra_energy_kwh: float
    price_per_gpu_hour: float | None
    extra_cost: float | None
    power_source: str
    times_from: str

    @property
    def extra_flops(self) -> int | None:
        """FLOPs the recompute adds over the whole run (all steps, all devices)."""
        if self.extra_flops_per_step is None:
            return None
        return self.extra_flops_per_step * self.steps * self.gpus

    @property
    def assumptions(self) -> tuple[str, ...]:
        """What the figures assume, one sentence each."""
        out = [f"seconds per step as profiled for {self.times_from}"
               + (f", taken as {self.target}" if self.times_from != self.target else ""),
               f"every extra second draws {self.board_power_w:g} W per device ({self.power_source})"]
        return tuple(out)

    def to_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "gpus": self.gpus, "target": self.target,
                "extra_flops_per_step": self.extra_flops_per_step,
                "extra_s_per_step": self.extra_s_per_step, "extra_gpu_hours": self.extra_gpu_hours,
                "board_power_w": self.board_power_w, "extra_energy_kwh": self.extra_energy_kwh,
                "price_per_gpu_hour": self.price_per_gpu_hour, "extra_cost": self.extra_cost,
                "power_source": self.power_source, "times_from": self.times_from,
                "assumptions": list(self.assumptions)}

    def __str__(self) -> str:
        from memfit.units import format_flops, format_seconds

        flops = (f"{format_flops(self.extra_flops_per_step)} recomputed" if self.extra_flops_per_step is not None
                 else "FLOPs not recorded (a plan made before memfit recorded them)")
        return "\n".join([f"extra per step: {flops}, +{format_seconds(self.extra_s_per_step)} on {self.target}",
                          *self.run_lines()])

    def run_lines(self) -> list[str]:
        """The run's figures and their assumptions, without the per-step line (``print(plan)``
        has it)."""
        lines = [f"over {self.steps:,} steps on {self.gpus} x {self.target}: "
                 f"+{_fig(self.extra_gpu_hours)} GPU-hours, {_fig(self.extra_energy_kwh)} kWh"
                 + (f", cost {_fig(self.extra_cost)} at {self.price_per_gpu_hour:g} per GPU-hour"
                    if self.extra_cost is not None and self.price_per_gpu_hour is not None else "")]
        return lines + [f"  assumes {a}" for a in self.assumptions]


def run_cost(plan: Plan, steps: int, gpus: int = 1, *, target: str | None = None,
             board_power_w: float | None = None, price_per_gpu_hour: float | None = None) -> RunCost:
    """``Plan.cost``: see there (NOTE [run cost])."""
    from memfit.timemodel.devices import PRESETS, profile_preset

    _positive_int("steps", steps, "the run's training steps, e.g. steps=100_000")
    _positive_int("gpus", gpus, "the devices running the step, e.g. gpus=8")
    timed = profile_preset(plan.profile_device) if plan.profile_device else None
    if target is None:
        if timed is None:
            where = (f"measured on {plan.profile_device!r}, which no preset names" if plan.profile_device
                     else "not recorded (a plan made before memfit recorded it)")
            raise ValueError(f"the device the plan's seconds are for is {where}; pass target= one of "
                             f"{sorted(PRESETS)} (the device they were measured on)")
        key = timed.name
    else:
        if not isinstance(target, str) or target.lower() not in PRESETS:
            raise ValueError(f"unknown target {target!r}; pass one of {sorted(PRESETS)}")
        key = target.lower()
        if timed is not None and timed.name != key:
            raise ValueError(
                f"the plan's seconds are for {timed.name} (its profile was made for "
                f"{plan.profile_device!r}), not {key}: charging them to {key} would mix devices. "
                f"Profile for {key} and plan again (memfit.profile(model, x, mode='fake', "
                f"target={key!r}), or memfit plan ... --target {key}), or pass target={timed.name!r}")
    dev = PRESETS[key]
    if board_power_w is None:
        if dev.board_power_w is None:
            raise ValueError(f"the {key} preset has no board power (a {key}'s draw depends on the "
                             "machine); pass board_power_w= in watts per device, e.g. 250")
        watts, source = float(dev.board_power_w), f"{dev.source}, max TDP"
    else:
        watts, source = _positive_float("board_power_w", board_power_w, "watts per device, e.g. 700"), "given"
    price = None
    if price_per_gpu_hour is not None:
        price = _positive_float("price_per_gpu_hour", price_per_gpu_hour, "a price per device-hour, e.g. 2.5",
                                allow_zero=True)
    hours = plan.recompute_s * steps * gpus / 3600
    return RunCost(steps=steps, gpus=gpus, target=key, extra_flops_per_step=plan.extra_flops,
                   extra_s_per_step=plan.recompute_s, extra_gpu_hours=hours, board_power_w=watts,
                   extra_energy_kwh=hours * watts / 1000, price_per_gpu_hour=price,
                   extra_cost=None if price is None else hours * price, power_source=source,
                   times_from=timed.name if timed is not None else (plan.profile_device or "an unrecorded device"))


def _fig(x: float) -> str:
    """A figure for people: ``12,346``, ``1.58``, ``0.00123``."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1 or x == 0:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _positive_int(name: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}; pass {what}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}; pass {what}")


def _positive_float(name: str, value: object, what: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}; pass {what}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value!r}; pass {what}")
    return v
