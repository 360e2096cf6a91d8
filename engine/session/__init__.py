"""The MinT session seam: the Protocol the loop talks to (``api``), the adapter over the
``mint`` SDK (``mint``), and what guards every call (``retry``, ``liveness``)."""
