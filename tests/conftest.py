"""Suite-wide settings: the Hugging Face hub is never reachable from tests."""

import atexit
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from tinker.lib.internal_client_holder import InternalClientHolder

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The local server files its tokenizer in the hub cache (engine/local/models/tokenizer_cache.py):
# tests use a private cache so they never write into the user's.
if "ENGINE_TEST_HUB_CACHE" not in os.environ:
    _hub_cache = tempfile.mkdtemp(prefix="engine-test-hub-")
    atexit.register(shutil.rmtree, _hub_cache, True)
    os.environ["ENGINE_TEST_HUB_CACHE"] = os.environ["HF_HUB_CACHE"] = _hub_cache
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The SDK's session heartbeat lives as long as its client object: a client a test drops
# keeps beating against a stopped server and prints a warning every few seconds for the
# rest of the run. Each test module closes the SDK clients it created (the engine's own
# session closes its client itself).
_sdk_holders: "weakref.WeakSet[InternalClientHolder]" = weakref.WeakSet()
_holder_init = InternalClientHolder.__init__


def _tracked_init(self: InternalClientHolder, *args: Any, **kwargs: Any) -> None:
    _holder_init(self, *args, **kwargs)
    _sdk_holders.add(self)


InternalClientHolder.__init__ = _tracked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True, scope="module")
def _close_sdk_clients() -> Iterator[None]:
    before = set(_sdk_holders)
    yield
    for holder in set(_sdk_holders) - before:
        holder.close()
