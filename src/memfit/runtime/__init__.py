"""Stage 3, runtime: put a ``Plan`` into effect on the unchanged module, with torch's own
non-reentrant checkpoint and selective policies; neither profile nor solve, and know no
process group.

Regions are wrapped modules (``wrap``) or chain segments over a Python loop (``segment``,
``replay``); a replay reads what its forward read (``bindings``, ``draws``, ``generators``),
writes module buffers once (``buffers``) and raises ``RecomputeMismatch`` where it diverges
(``divergence``, ``fingerprints``). Every private torch API it needs is in ``memfit._torch``.

Public names (import them from their modules; this package re-exports nothing):
    apply.apply and apply.unapply (``memfit.apply`` is ``memfit.api.apply``, this ``apply`` made
    a collective in a distributed job; ``memfit.unapply``), marks.applied_plan
    (``memfit.applied_plan``), wrap.wrap and wrap.unwrap, checkpoint.checkpoint, policies
    (``memfit.policies``), divergence.DivergenceCheck, apply.host_pool.
"""
