"""The simulation layer: the task graph of a plan, the event simulator that scores a plan as a
Timeline, the physical lower bound over all plans, and the host-memory model of a plan. Imports
only harmony_opt.core.
"""
