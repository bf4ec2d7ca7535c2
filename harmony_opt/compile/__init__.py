"""The compile layer: the Program (per-rank instruction streams with their memory effects) and the
compiler that lowers a Plan to it. The runtime executes Programs; training.train drives both.
"""
