"""Jobs over several processes: one plan per job (``distributed``: plan on one rank, broadcast,
agree at apply) and pipeline schedules (``pipeline``: in-flight micro-batches per stage).
Above the runtime, below measuring (``memfit.parallel.distributed`` and ``memfit.parallel.pipeline`` are these
modules, as the public API names them)."""
