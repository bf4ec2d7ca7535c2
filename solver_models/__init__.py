"""CP-SAT formulations: each builds a model from (Profile, Hardware, options), solves it and
returns a Plan with the solver's statistics. ``planner.plan`` is the entry point."""
