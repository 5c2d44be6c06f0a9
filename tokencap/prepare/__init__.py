"""Before and after a run: plan, init, audit."""
