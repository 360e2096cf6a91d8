"""The base models a local server serves, known to the client and the server alike:
the packaged and the opt-in pretrained models by name, their directories, the metadata
a model directory records (``engine_model.json``) and the RL settings it recommends.

Below both sides (docs/architecture.md): the engine names, checks and records a model
and reads what a server on it will recommend without importing the server; the server
loads it. Importing this package reads and downloads nothing (the standard library and
:mod:`engine.common` only); converting a pretrained model happens on first use, in
:func:`~engine.basemodels.catalogue.resolve_model`, which the server's launcher calls.
"""
