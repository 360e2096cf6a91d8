"""What the local server holds of its models: the LoRA adapters over one frozen base
model (``lora.py``) and each training client's state (``training_state.py``), the
checkpoint format on disk (``checkpoint.py``) and where checkpoints live
(``storage.py``), and the served model's tokenizer, loadable by name
(``tokenizer_cache.py``). Which base models exist is :mod:`engine.basemodels`."""
