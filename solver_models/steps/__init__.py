"""The planner's steps, in the order plan() runs them (solver_models/planner.py):

1. first: Harmony's search as hint, then a first solution per configuration (first.py);
2. improve: local search and CP-SAT on the most promising configurations (improve.py);
3. select: the simulator judges the candidates, then polishes the winner (select.py);
4. order: the event-schedule model of the chosen plan and the order of its transfers (order.py)."""
