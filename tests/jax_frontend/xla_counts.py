"""What XLA reports for a lowered step, read here as the tests count it (independently of
``memfit.jax.measured``)."""


def xla_flops(lowered) -> int:
    """``cost_analysis()`` FLOPs of the compiled step."""
    ca = lowered.compile().cost_analysis()
    return int((ca[0] if isinstance(ca, list) else ca)["flops"])


def xla_peak(lowered) -> int:
    """``memory_analysis()`` temp + output - alias bytes of the compiled step."""
    m = lowered.compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
