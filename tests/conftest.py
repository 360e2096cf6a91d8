"""Suite-wide settings: the Hugging Face hub is never reachable from tests."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The local server files its tokenizer in the hub cache (engine/local/tokenizer_cache.py):
# tests use a private cache so they never write into the user's.
if "ENGINE_TEST_HUB_CACHE" not in os.environ:
    _hub_cache = tempfile.mkdtemp(prefix="engine-test-hub-")
    atexit.register(shutil.rmtree, _hub_cache, True)
    os.environ["ENGINE_TEST_HUB_CACHE"] = os.environ["HF_HUB_CACHE"] = _hub_cache
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
