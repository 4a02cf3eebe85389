"""The time model, torch-free (the planner reads it and so may a JAX front end): device presets
and the roofline op-time model (``devices``), and the recompute time model a Profile carries,
its defaults and its fit to timed steps (``calibration``)."""

from __future__ import annotations

from memfit.timemodel.calibration import Calibration, CalibrationSource, TimeTerms, fit_calibration
from memfit.timemodel.devices import PRESETS, DevicePreset, preset

__all__ = ["Calibration", "CalibrationSource", "TimeTerms", "fit_calibration", "PRESETS",
           "DevicePreset", "preset"]
