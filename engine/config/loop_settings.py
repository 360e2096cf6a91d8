"""The settings of how the loop runs: the pipeline's size and overlap, running the
reward, an environment task's episodes, held-out evaluation, checkpoints."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, model_validator
from pydantic_core import PydanticCustomError

from engine.common.setting import (
    Setting,
    finite_non_negative,
    finite_positive,
    non_negative,
    positive,
)
from engine.config.settings_group import SettingsGroup, rule
from engine.config.values import (
    DirectoryPath,
    OnRewardError,
    ScoreWorkers,
    parse_score_workers,
    pass_k_problem,
)
from engine.core.trajectory import EpisodeLimits, OnLimit, OnParseError
from engine.errors import ConfigError

__all__ = [
    "CheckpointSettings",
    "EnvironmentSettings",
    "EvaluationSettings",
    "PipelineSettings",
    "ScoringSettings",
]


def _score_workers(v: Any) -> Any:
    """``threads``, ``processes:N`` or ``ray:N`` as :class:`ScoreWorkers`, parsed once."""
    if isinstance(v, ScoreWorkers):
        return v
    try:
        return parse_score_workers(str(v))
    except ValueError as exc:
        raise PydanticCustomError("score_workers", str(exc)) from None


def _each_positive(v: Any) -> str | None:
    return "must be positive integers" if any(k < 1 for k in v) else None


class PipelineSettings(SettingsGroup):
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
    max_steps_off_policy: Annotated[int, rule(non_negative)] = Field(
        1,
        description="K: how many steps sampling may run ahead of training (0 = on-policy, "
        "the quickstart's algorithm)",
    )
    submit_ahead: Annotated[int, rule(non_negative)] = Field(
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
    refill_groups: Annotated[int, rule(non_negative)] = Field(
        0,
        description="dynamic sampling (DAPO): each step draws this many reserve problems and "
        "samples one for each of its groups that carries no signal (rewards all tie, a reward "
        "error, a prompt too long), until --batch groups carry one or the reserves run out "
        "(0: off; the step trains on fewer groups; docs/losses.md)",
    )
    start_window: Annotated[
        int | None, Setting(check=non_negative, unset="K", resume="changeable")
    ] = Field(
        None,
        description="W: a drawn step's groups start once the newest weights are at most W "
        "steps behind it (at most K; unset: K, as early as the staleness window allows); "
        "below K with --step-order completion a group may train up to K - W steps after "
        "the step it was drawn for, so a straggler trains in a later step while groups "
        "that finished fill its own",
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
    concurrency: Annotated[int, rule(positive, resume="changeable")] = Field(
        64, description="max sample requests in flight"
    )
    stall_timeout: Annotated[float, rule(finite_positive, resume="changeable")] = Field(
        1800.0,
        description="stop the run (with a checkpoint) when no group was sampled and no step "
        "trained for this many seconds",
    )

    @model_validator(mode="after")
    def _start_within_window(self) -> PipelineSettings:
        w, k = self.start_window, self.max_steps_off_policy
        if w is not None and w > k:
            raise ConfigError(f"--start-window {w} must not exceed --max-steps-off-policy {k}")
        if w is not None and w < k and self.step_order == "problem":
            raise ConfigError(
                f"--start-window {w} below --max-steps-off-policy {k} needs --step-order "
                f"completion (in problem order a step trains its own groups: use "
                f"--max-steps-off-policy {w})"
            )
        return self

    @property
    def start_lag(self) -> int:
        """W: how far behind a drawn step the newest weights may be when its groups
        start (``--start-window``, else K)."""
        return self.max_steps_off_policy if self.start_window is None else self.start_window


class ScoringSettings(SettingsGroup):
    """Running the reward."""

    score_concurrency: Annotated[int, rule(positive)] = Field(
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

    overlong_buffer: Annotated[int, rule(non_negative)] = Field(
        0,
        description="soft overlong penalty (DAPO): a response in the last N tokens of "
        "--max-tokens gets a reward falling linearly from 0 to -F at --max-tokens, F the "
        "overlong penalty (an episode: summed over its turns; 0: off; docs/losses.md)",
    )
    overlong_penalty: Annotated[float, rule(finite_non_negative)] = Field(
        1.0, description="with --overlong-buffer: the penalty of a response of --max-tokens tokens"
    )


class EnvironmentSettings(SettingsGroup):
    """The limits of an environment task's episodes."""

    env_max_turns: Annotated[int, rule(positive)] = Field(
        8, description="environment tasks: most actions per episode"
    )
    env_max_tokens: Annotated[int, rule(positive)] = Field(
        8192,
        description="environment tasks: longest context (observation + action tokens) of an "
        "episode; at most the served model's context",
    )
    episode_timeout: Annotated[float, rule(finite_non_negative)] = Field(
        0.0, description="environment tasks: seconds an episode may run (0: no limit)"
    )
    tool_timeout: Annotated[float, rule(finite_non_negative)] = Field(
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


class EvaluationSettings(SettingsGroup):
    """Held-out evaluation."""

    eval_every: Annotated[int, rule(non_negative)] = Field(
        0,
        description="evaluate the task's held-out problems greedily every N steps and at the "
        "start (eval/* metrics; 0: never)",
    )
    eval_samples: Annotated[int, rule(non_negative)] = Field(
        0,
        description="with --eval-every: also N responses per held-out problem at --temperature "
        "(eval/sampled/* mean reward, pass@1, pass@N; 0: greedy only, or the largest "
        "--eval-k)",
    )
    eval_k: Annotated[tuple[int, ...], rule(_each_positive)] = Field(
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


class CheckpointSettings(SettingsGroup):
    """Saving and resuming."""

    checkpoint_every: Annotated[int, rule(non_negative, resume="changeable")] = Field(
        10, description="save_state every N steps (0: only the initial, stop and final checkpoints)"
    )
    resume: Annotated[DirectoryPath, Setting(resume="current", unset="off")] = Field(
        None, description="continue the run in this run directory from its latest checkpoint"
    )
