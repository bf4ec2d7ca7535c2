"""The planner layer: the baseline planners (L2L, naive swap, Harmony's search wrapped as a
planner), their registry and the scoring used by `harmony-opt plan --compare`. Built on core,
sim and harmony; the CP-SAT planner itself is harmony_opt.solver_models (folder solver_models/).
"""
