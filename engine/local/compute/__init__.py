"""The local server's compute: the one thread every torch call runs on (``thread.py``),
the backend it calls (``backend.py``, its values and error in ``backend_types.py``), and
what the backend is made of: batched sampling with a KV cache (``sampling.py``), the
training losses (``losses.py``, ``rollout_correction.py``, ``stability.py``), datum
validation and packing (``datums.py``) and the shared-prefix forward (``prefix.py``)."""
