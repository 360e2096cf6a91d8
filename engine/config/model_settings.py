"""The settings of what is trained and how it is sampled: the task, the model and its
LoRA adapter, the sampling."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field

from engine.common.setting import Setting, non_empty, positive
from engine.common.setting import seed as seed_range
from engine.config.settings_group import SettingsGroup, rule
from engine.errors import ConfigError

__all__ = ["ModelSettings", "SamplingSettings", "TaskSettingsGroup"]


def _tinker_weights(v: Any) -> str | None:
    ok = str(v).startswith("tinker://") and "/weights/" in str(v)
    return None if ok else "must be a tinker://.../weights/NAME path"


def _sampling_temperature(v: Any) -> str | None:
    if not math.isfinite(v) or v < 0:
        return "must be a number > 0"
    if v == 0:
        return (
            "must be > 0: temperature 0 samples greedily, so every response of a group is "
            "the same, no group has a reward difference and nothing is trained"
        )
    return None


class TaskSettingsGroup(SettingsGroup):
    """What is trained on: the task and its arguments."""

    spec: Annotated[str, Setting(flag="--task", flat="task", check=non_empty)] = Field(
        "arithmetic",
        description="'arithmetic', a JSONL dataset 'jsonl:PATH', a Hugging Face dataset on "
        "disk 'hf:PATH', a shipped environment ('guess-sum', 'calculator'), a user task "
        "'package.module:attr', or any of these scored by an LLM judge 'judge:SPEC'",
    )
    args: Annotated[dict[str, str], Setting(flag="--task-arg", flat="task_args")] = Field(
        default_factory=dict,
        description="an argument of the task (repeatable KEY=VALUE), e.g. reward=numeric "
        "for jsonl tasks",
    )
    seed: Annotated[int, rule(seed_range)] = Field(42, description="seed of the problem source")


class ModelSettings(SettingsGroup):
    """The model and its LoRA adapter."""

    base_model: Annotated[
        str | None, Setting(env=("MINT_BASE_MODEL",), check=non_empty, recommended=True)
    ] = Field(None, description="model to fine-tune")
    lora_rank: Annotated[
        int | None, Setting(env=("MINT_LORA_RANK",), check=positive, recommended=True)
    ] = Field(None, description="LoRA rank")
    lora_seed: Annotated[int | None, Setting(check=seed_range, unset="none")] = Field(
        None,
        description="seed of the LoRA initialisation (the quickstart leaves it to the server; "
        "unset: --seed)",
    )
    init_from: Annotated[str | None, Setting(check=_tinker_weights, unset="off")] = Field(
        None,
        description="start from these saved weights (tinker://.../weights/NAME) instead of a "
        "fresh LoRA",
    )
    init_from_optimizer: bool = Field(
        False, description="with --init-from: load the optimizer state too (else weights only)"
    )


class SamplingSettings(SettingsGroup):
    """How responses are sampled."""

    max_tokens: Annotated[int, Setting(env=("MINT_CUSTOM_REWARD_MAX_TOKENS",), check=positive)] = (
        Field(16, description="max tokens per sampled response")
    )
    temperature: Annotated[
        float | None,
        Setting(
            env=("MINT_CUSTOM_REWARD_TEMPERATURE",),
            check=_sampling_temperature,
            recommended=True,
        ),
    ] = Field(
        None,
        description="sampling temperature (> 0: a group needs different responses to learn "
        "from); unset: the server's recommendation (the engine's local server: 0.8, with the "
        "loss scored at it), else 1, where a hosted sampler's tempered logprobs are the "
        "model's own (docs/losses.md, 'Which default, and why')",
    )

    @property
    def resolved_temperature(self) -> float:
        """The temperature a resolved config samples at (unset only until the server's
        recommendation is known)."""
        if self.temperature is None:
            raise ConfigError("temperature is unset: the config is not resolved against a server")
        return self.temperature

    stop_at_eos: bool = Field(
        False,
        description="stop sampling at the tokenizer's EOS (off, like the quickstart: "
        "tinker 0.22 drops its stop_token_ids)",
    )
    keep_stop_text: bool = Field(
        False,
        description="the text a reward sees keeps its stop string and EOS token, as the "
        "quickstart decodes it (off: cut before them, e.g. ' 76' not ' 76</s>')",
    )
    sampling_seed: Annotated[int | None, Setting(check=seed_range, unset="none")] = Field(
        None,
        description="one seed sent with every sample request, as the quickstart sends it "
        "(unset: each request's seed is derived from --seed, its step, group, episode and turn, "
        "so a run repeats)",
    )
