"""The run directory: which one a run uses, its config, checkpoints and event log."""
