"""Stage 2, planning: pure functions from a ``Profile`` to the fastest ``Plan`` that fits a budget.

Nothing here runs a module or touches a tensor: the solvers (``solvers/``) search the plan
space (``candidates``) on a linear memory model (``effects``, ``costs``, ``nesting``,
``offload``); ``simulate`` predicts a plan's peak and recompute time exactly, with the time
model of ``memfit.timemodel``. Plans are frozen data with a JSON round-trip: the input of
``memfit.runtime``.

Public names (import them from their modules; this package re-exports nothing):
    planner.plan (``memfit.plan``), simulate.simulate and simulate.Simulation
    (``memfit.simulate``), plan.Plan, plan.Region, plan.OpPolicy (``memfit.Plan``, ...),
    solvers.SOLVERS.
"""
