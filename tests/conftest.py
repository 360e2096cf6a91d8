"""Suite-wide settings: the Hugging Face hub is never reachable from tests."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
