"""Supervision of a run: checkpoints at the right moments, exactly-once recovery, stops,
deadlines, the circuit breaker and the watchdogs."""
