"""The settings of how the policy is trained: the optimiser and the loss
(:class:`TrainingSettings`), and the settings groups of the objectives that have their
own: on-policy distillation's teacher, DPO's beta."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field, model_validator

from engine.common.setting import Setting, finite_non_negative, finite_positive, non_empty
from engine.config.settings_group import SettingsGroup, rule
from engine.config.values import (
    LOSSES,
    LossName,
    LossTemperature,
    RolloutCorrectionName,
)
from engine.core.datums import OnMissingLogprobs
from engine.errors import ConfigError

__all__ = ["DistillationSettings", "PreferenceSettings", "TrainingSettings"]


class TrainingSettings(SettingsGroup):
    """The optimiser and the loss."""

    learning_rate: Annotated[
        float | None,
        Setting(
            flag="--lr", env=("MINT_CUSTOM_REWARD_LR",), check=finite_positive, recommended=True
        ),
    ] = Field(None, description="Adam learning rate")
    objective: Annotated[str, Setting(check=non_empty, metavar="NAME")] = Field(
        "rl",
        description="what the run trains for, an objective of engine/objectives/registry.py: "
        "rl: train on rewards; sft: supervised fine-tuning on the assistant turns of "
        "a jsonl task's conversations (the cross_entropy loss; --loss is not used; docs/sft.md); "
        "distill: on-policy distillation from --teacher (docs/distillation.md); dpo: preference "
        "pairs of a jsonl task (prompt, chosen, rejected) through the SDK's custom loss "
        "(--loss is not used; docs/dpo.md)",
    )
    loss: LossName = Field(
        "ppo",
        description=f"loss function: {', '.join(LOSSES)} (gspo, stable_reinforce: the tinker "
        "SDK only, with the server's default loss_fn_config; see docs/losses.md)",
    )
    clip_low: Annotated[float, rule(finite_positive)] = Field(
        0.8, description="lower ratio clip for ppo/cispo"
    )
    clip_high: Annotated[float, rule(finite_positive)] = Field(
        1.2, description="upper ratio clip for ppo/cispo"
    )
    dro_beta: Annotated[float, rule(finite_non_negative)] = Field(
        0.05, description="beta of the dro loss"
    )
    tis_cap: Annotated[float, rule(finite_non_negative)] = Field(
        0.0,
        description="TIS (truncated importance sampling): importance_sampling weighs each "
        "token's policy gradient by its importance ratio truncated at this cap, without "
        "gradient through it (0: off; the engine's local server only; docs/losses.md)",
    )
    mask_low: Annotated[float, rule(finite_non_negative)] = Field(
        0.0,
        description="with --mask-high: MIS / IcePop, importance_sampling and ppo leave out "
        "each token whose importance ratio is below this (the engine's local server only)",
    )
    mask_high: Annotated[float, rule(finite_non_negative)] = Field(
        0.0,
        description="MIS / IcePop: importance_sampling and ppo leave out each token whose "
        "importance ratio is above this or below --mask-low (0: off; IcePop uses 0.5 and 2; "
        "the engine's local server only; docs/losses.md)",
    )
    loss_temperature: Annotated[LossTemperature | None, Setting(recommended=True)] = Field(
        None,
        description="sampling: the RL losses score the sampled tokens at --temperature, the "
        "distribution they were drawn from, so an on-policy importance ratio is exactly 1; "
        "off: at the model's own logits, the quickstart's (the engine's local server "
        "recommends sampling, which only it takes; docs/losses.md)",
    )
    rollout_correction: RolloutCorrectionName = Field(
        "off",
        description="MinT's session-level rollout correction, sent with create_model and applied "
        "by the server inside every importance_sampling forward_backward: mis (its quickstart's: "
        "sequence importance weights truncated at 1.1, sequences whose summed log ratio leaves "
        "[log 0.5, log 2] rejected, REINFORCE; docs/losses.md); off: none. Needs --loss "
        "importance_sampling and the mint SDK; hosted MinT and the engine's local server take it",
    )
    on_missing_logprobs: OnMissingLogprobs = Field(
        "error",
        description="a response without sampler logprobs: stop the run, or drop it and count it",
    )
    overlong_filter: bool = Field(
        False,
        description="overlong filtering (DAPO): leave a response cut at --max-tokens (no stop "
        "string or EOS) out of the loss and its group's baseline; an episode: any turn cut so, "
        "or its context ran out (docs/losses.md)",
    )

    @model_validator(mode="after")
    def _clip_order(self) -> TrainingSettings:
        if self.clip_low > self.clip_high:
            raise ConfigError(
                f"clip_low ({self.clip_low}) must not exceed clip_high ({self.clip_high})"
            )
        return self

    @model_validator(mode="after")
    def _corrections(self) -> TrainingSettings:
        if self.tis_cap and self.loss != "importance_sampling":
            raise ConfigError(
                f"--tis-cap is for --loss importance_sampling, not {self.loss} (ppo bounds "
                "its ratio with its clip; docs/losses.md)"
            )
        if self.mask_low and not self.mask_high:
            raise ConfigError("--mask-low needs --mask-high (0: no mask)")
        if self.mask_high and self.loss not in _MASKED_LOSSES:
            raise ConfigError(
                f"--mask-low/--mask-high are for --loss {' or '.join(_MASKED_LOSSES)}, "
                f"not {self.loss}"
            )
        if self.rollout_correction != "off":
            if self.loss != "importance_sampling":
                raise ConfigError(
                    f"--rollout-correction {self.rollout_correction} is applied by the server "
                    "inside importance_sampling: it needs --loss importance_sampling"
                )
            if self.tis_cap or self.mask_high:
                raise ConfigError(
                    f"--rollout-correction {self.rollout_correction} corrects on the server; "
                    "--tis-cap and --mask-low/--mask-high would correct a second time"
                )
        if self.mask_high and self.mask_low >= self.mask_high:
            raise ConfigError(
                f"--mask-low ({self.mask_low}) must be below --mask-high ({self.mask_high})"
            )
        return self

    def local_loss_options(self) -> list[str]:
        """The flags set here that only the engine's local server's losses take (a hosted
        server refuses loss_fn_config keys it does not know)."""
        return [
            flag
            for flag, on in (
                ("--tis-cap", self.tis_cap > 0),
                ("--mask-low", self.mask_low > 0),
                ("--mask-high", self.mask_high > 0),
                ("--loss-temperature sampling", self.loss_temperature == "sampling"),
            )
            if on
        ]

    def loss_fn_config(self, sampling_temperature: float) -> dict[str, float] | None:
        """The ``loss_fn_config`` sent with forward_backward for the chosen loss, its
        off-policy corrections and (``--loss-temperature sampling``) the temperature
        responses are sampled at; None when there is nothing to send. ``--objective sft``
        sends none of these (cross_entropy has no ratio)."""
        config: dict[str, float] = {}
        if self.loss in ("ppo", "cispo"):
            config |= {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high}
        elif self.loss == "dro":
            config["beta"] = self.dro_beta
        if self.tis_cap:
            config["tis_cap"] = self.tis_cap
        if self.mask_high:
            config |= {"mask_low": self.mask_low, "mask_high": self.mask_high}
        if self.loss_temperature == "sampling":
            config["temperature"] = sampling_temperature
        return config or None


_MASKED_LOSSES: Final = ("importance_sampling", "ppo")
"""The losses the local server masks by their importance ratio (MIS / IcePop)."""


class DistillationSettings(SettingsGroup):
    """On-policy distillation (``--objective distill``): the teacher and how its signal
    is weighed (docs/distillation.md)."""

    teacher: Annotated[str | None, Setting(check=non_empty, unset="none")] = Field(
        None,
        description="the teacher: saved sampler weights (tinker://.../sampler_weights/NAME), a "
        "run directory (its latest checkpoint) or a base model name; it must have the "
        "student's tokenizer",
    )
    distill_coef: Annotated[float, rule(finite_positive)] = Field(
        1.0,
        description="per-token advantage = this x (teacher logprob - student logprob) of each "
        "sampled token (the reverse-KL signal)",
    )
    distill_reward_weight: Annotated[float, rule(finite_non_negative)] = Field(
        0.0,
        description="weight of the task's group-relative reward advantage added to every "
        "token's distillation advantage (0: the teacher alone)",
    )


class PreferenceSettings(SettingsGroup):
    """Preference pairs (``--objective dpo``): how far the policy may move from the
    reference (docs/dpo.md)."""

    dpo_beta: Annotated[float, rule(finite_positive)] = Field(
        0.1,
        description="beta of the DPO loss -log sigmoid(beta x ((policy - reference logprob of "
        "the chosen response) - (the same of the rejected one)))",
    )
