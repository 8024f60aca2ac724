"""Stage 3, problem: node options, the cost model and the user's constraints
as a torch-free :class:`solver.Problem` (edge matrices, memory budget,
size guard, infeasibility in the user's terms, option pricing)."""
