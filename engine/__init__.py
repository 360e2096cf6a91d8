"""engine: an async, pipelined RL training engine for MinT."""
