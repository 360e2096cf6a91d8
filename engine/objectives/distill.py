"""``--objective distill``: on-policy distillation from ``--teacher``. RL's steps
(:mod:`engine.objectives.rl`) whose groups the teacher scores too: each datum carries
the teacher's per-token signal (docs/distillation.md).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.objectives.base import Headline, RunContext
from engine.objectives.rl import RlObjective, RlRun
from engine.session.capabilities import Need, prompt_logprobs_need

__all__ = ["DISTILL", "DistillObjective"]


class DistillObjective(RlObjective):
    name = "distill"
    takes_teacher = True
    own_settings: str | None = "distillation"
    headlines = (Headline("distill/reverse_kl", "reverse KL to the teacher per sampled token"),)

    def check_config(self, config: EngineConfig, chosen: bool) -> None:
        """Its teacher; RL's checks are the rl objective's own (``--group``, for one)."""
        if chosen != (config.distillation.teacher is not None):
            raise ConfigError(
                "--objective distill needs --teacher (a tinker:// sampler path, a run "
                "directory or a base model name), and --teacher needs --objective distill"
            )

    def open(self, context: RunContext) -> RlRun:
        return RlRun(context, distill=True)

    def needs(self, config: EngineConfig) -> list[Need]:
        return [*super().needs(config), prompt_logprobs_need(self.loss_setting(config))]


DISTILL = DistillObjective()
