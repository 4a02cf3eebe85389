"""Stage 1, profiling: trace one training step op by op into a ``Profile``; decide nothing.

The tracer runs the step under a dispatch mode, module hooks and saved-tensor hooks and
records every op (module, storages, saved-for-backward bytes, seconds, kernel workspace); in
fake mode it traces a model on the meta device, its op times from a device preset. Profiles
are frozen data with a JSON round-trip (``schema_version``): the input of ``memfit.planning``.

Public names (import them from their modules; this package re-exports nothing):
    tracer.profile (the trace alone; ``memfit.profile`` adds the calibrated time model,
    ``memfit.measuring.calibration``), tracer.ProfileMode, profile.Profile (``memfit.Profile``),
    measure.measure and measure.Measurement (``memfit.measure``), summary.summarize,
    memfit.timemodel.devices.PRESETS.
"""
