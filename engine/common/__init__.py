"""What the client and the local server share: command-line basics and the optional
extras. Imports nothing of either side."""
