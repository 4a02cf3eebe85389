"""Measuring: run planned and plain steps and compare them, above the three stages.

It composes profiling, planning and runtime on real steps: the calibrated profile (timing
baseline plans to fit ``memfit.timemodel``'s parameters, with the dispatch charges measured on
this machine), ``verify`` (the planned step against its un-checkpointed twin), ``tune``
(measured selection among the best few plans), ``sweep`` (plans at several budgets, measured)
and the ``Sweep`` report (tables, JSON, plot). Steps run on twins, plain copies of the model
(``twins``), or on the model itself, left as found.

Public names (import them from their modules; this package re-exports nothing):
    calibration.profile (``memfit.profile``), verification.verify and
    verification.VerifyReport (``memfit.verify``), tradeoff.sweep (``memfit.sweep``),
    report.Sweep (``memfit.Sweep``), tuning.tune (``memfit.fit(..., tune=True)``),
    comparison.Comparison, report.print_sweep, verification.print_verify.
"""
