"""The measurement layer: cut models into layers (decompose, models), measure their per-layer costs
(profiler) and the machine's bandwidths (probe), and build synthetic profiles calibrated on a
measured one (synthetic). Torch-based except synthetic; imports only harmony_opt.core.
"""
