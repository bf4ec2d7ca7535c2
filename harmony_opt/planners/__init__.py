"""The planner layer: the baseline planners (L2L, naive swap, Harmony's search wrapped as a
planner), the registry of every planner by name (ours included, resolved on first use) and the
scoring used by `harmony-opt compare`. Built on core, compile, sim and harmony; the CP-SAT planner
itself is harmony_opt.solver_models (folder solver_models/).
"""
