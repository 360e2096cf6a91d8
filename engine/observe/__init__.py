"""What a person or a tool reads about a run: per-step metrics, experiment trackers,
and the figures behind the report."""
