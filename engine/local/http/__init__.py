"""The local server's HTTP front: FastAPI routes (``app.py``, ``management_routes.py``),
pure-ASGI middleware (counting, ``--faults``, authentication: ``middleware.py``,
``auth.py``, ``rate_limit.py``), bounded request bodies (``bodies.py``) and the wire
formats (``wire.py`` for JSON, ``tinker_proto`` for tinker >= 0.38's protobuf). It
decodes requests into the operations' values and encodes their results; nothing here
touches torch."""
