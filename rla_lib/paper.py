"""The paper's published numbers that this project tests, in one place: cited, never measured here.

*Where Rounding Happens Matters: Rounding-Location Alignment Stabilizes LLM Reinforcement Learning*. The README's
verdicts and notebooks 02-05 compare measured intervals with these ranges; `tests/test_readme.py` allows a number
in the README's prose only if it is rendered from a table or listed here (or is a setting checked against the code).
"""

GAP_REDUCTION = (-0.25, -0.10)  # Table 1: aligning all three regions changes the KL gap by -25% to -10%
ROPE_SHAPLEY_SHARE = (0.769, 0.918)  # RoPE's Shapley share of that reduction on its three models (76.9-91.8%)
UNIFORM_FOURIER_RMS = (1.5e-5, 8.0e-4)  # projection, attention and RMSNorm outputs: nearly uniform rounding positions
CLUSTERED_FOURIER_RMS = (0.038, 0.472)  # SiLU outputs, RoPE products, residual sums: clustered
ROPE_ONLY_OVERHEAD = (0.0090, 0.0204)  # RoPE-only alignment's share of training compute time
ALL_THREE_OVERHEAD = (0.0533, 0.1092)  # all three regions' added forward-and-backward time
ROUNDING_EXAMPLE = (1.003, 3)  # the worked example: one op yields 1.003, the next multiplies by 3


def percent_range(low: float, high: float) -> str:
    """A range of fractions as the paper's prose writes it: (0.769, 0.918) -> "77-92%"; signs dropped."""
    a, b = sorted((abs(low), abs(high)))
    return f"{a:.0%}-{b:.0%}".replace("%-", "-")
