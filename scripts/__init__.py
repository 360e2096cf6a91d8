"""Maintenance scripts of the checkout (``python -m scripts.<name>``)."""
