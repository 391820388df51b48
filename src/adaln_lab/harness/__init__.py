"""The seed report's protocol on any candidate: inputs, invariance, accuracy, latency, report, table.

A candidate is a callable `fn(x, norm_weight, temb, weight, bias, timestep_indices) -> out`
(see `candidates.py`); every check takes one.
"""
