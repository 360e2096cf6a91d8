"""The MinT quickstart's ``custom_reward.py`` loop, re-implemented call for call.

This is the baseline a MinT user has today, and the yardstick the engine is measured
against (throughput) and compared with (datum parity of the engine's K=0 mode). It keeps
the script's structure exactly, with the sync SDK calls, one after another:

* per step, a new sampler snapshot (``save_weights_and_get_sampling_client``);
* for each of ``batch`` problems in turn: draw the problem, ``sample(...).result()`` with
  ``num_samples=group``, decode and score every response, advantages = reward - group
  mean, skip empty responses and |advantage| < 1e-12;
* ``forward_backward(..., "importance_sampling").result()`` and only THEN
  ``optim_step(AdamParams(learning_rate=lr)).result()``;
* the same ``Step N: ...`` line per step and ``save_weights_for_sampler`` at the end.

What is parametrised (the script reads most of it from the environment): server URL and
key, model, LoRA rank, task operation and operand range, steps, batch, group, max tokens,
temperature, learning rate and problem seed; plus two optional seeds (LoRA init and
sampling, both off by default) that make two runs comparable in tests. With the default
arguments the SDK calls and their wire content are the quickstart's. Two differences are
deliberate and wire-neutral: the script's ``stop_token_ids=[eos]`` is not passed (the
pinned SDK's ``SamplingParams`` silently drops that keyword, so the script sends no stop
list either) and neither is the deprecated, ignored ``name=`` of the snapshot call.

The problems, the prompt text and the reward come from the engine's arithmetic task
(``engine.tasks.ArithmeticTask``), whose seeded source draws ``a`` then ``b`` with
``random.Random(seed).randint`` exactly as the script's ``generate_problem`` does, and
whose reward ``tests/test_rewards.py`` checks against the quickstart's component by
component. The datum layout is written out here (not imported from ``engine.core.datums``) so the
engine's copy is compared with an independent one.

Each step also records how long its snapshot, sampling, scoring and training took
(``time.perf_counter`` spans), for the throughput benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mint
from mint import types

from benchmarks.measure import Span, process_cpu_seconds
from engine.tasks import ArithmeticTask, RewardBreakdown

__all__ = ["QuickstartRun", "QuickstartStep", "Span", "run_quickstart_loop"]

_ADVANTAGE_EPSILON = 1e-12


@dataclass(frozen=True)
class QuickstartStep:
    """Timings and volumes of one quickstart step (1-based ``step``).

    ``*_s`` are busy seconds per stage: the snapshot call, the sum of the ``sample``
    calls, the sum of decoding + scoring, and ``forward_backward`` + ``optim_step``."""

    step: int
    start: float
    end: float
    snapshot_s: float
    sample_s: float
    score_s: float
    train_s: float
    samples: int
    tokens: int
    datums: int
    spans: tuple[Span, ...] = field(repr=False)

    @property
    def step_s(self) -> float:
        return self.end - self.start


@dataclass
class QuickstartRun:
    """What the loop printed and sent: per step its line, its datums (exactly as passed
    to ``forward_backward``), its questions and its timings; the final sampler path."""

    lines: list[str] = field(default_factory=list)
    datums: list[list[types.Datum]] = field(default_factory=list, repr=False)
    questions: list[list[str]] = field(default_factory=list)
    steps: list[QuickstartStep] = field(default_factory=list)
    saved_path: str = ""
    started: float = 0.0
    """``perf_counter`` when the first step began (after connecting and the tokenizer)."""
    finished: float = 0.0
    """``perf_counter`` when the last step's optim_step returned."""
    cpu_s: float = 0.0
    """This process's CPU seconds (all threads) from ``started`` to ``finished``."""


def _datum(
    prompt: list[int], response: list[int], logprobs: list[float], advantage: float
) -> types.Datum:
    """The quickstart's ``build_rl_datum``: zero weight/logprob/advantage over the first
    ``len(prompt) - 1`` positions, then the response."""
    prefix_len = len(prompt) - 1
    full = prompt + response
    n = len(response)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "weights": [0.0] * prefix_len + [1.0] * n,
            "logprobs": [0.0] * prefix_len + logprobs,
            "advantages": [0.0] * prefix_len + [advantage] * n,
        },
    )


def _summary_line(step: int, breakdowns: list[RewardBreakdown], datums: int) -> str:
    """The quickstart's ``summarize_breakdowns`` + its print format."""
    n = len(breakdowns)
    avg = sum(b.total for b in breakdowns) / n if n else 0.0
    exact = sum(1 for b in breakdowns if b.components.get("exact_bonus", 0.0) > 0) / n if n else 0.0
    fmt = sum(1 for b in breakdowns if b.components.get("format_reward", 0.0) > 0) / n if n else 0.0
    return (
        f"Step {step}: avg_reward={avg:.3f}, exact_rate={exact:.1%}, "
        f"format_rate={fmt:.1%}, datums={datums}"
    )


def run_quickstart_loop(
    *,
    base_url: str,
    api_key: str,
    base_model: str,
    rank: int = 16,
    steps: int = 8,
    batch: int = 8,
    group: int = 6,
    lr: float = 2e-5,
    max_tokens: int = 16,
    temperature: float = 0.8,
    seed: int = 42,
    op: str = "*",
    min_operand: int = 10,
    max_operand: int = 199,
    lora_seed: int | None = None,
    sampling_seed: int | None = None,
    echo: Callable[[str], None] | None = None,
) -> QuickstartRun:
    """Run the quickstart loop against ``base_url`` and return what it printed, sent
    and measured. The defaults are the quickstart's own (hosted model names aside).
    ``echo`` receives each printed line (``Step N: ...``, ``Saved: ...``)."""
    for name, value in (("steps", steps), ("batch", batch), ("group", group)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    task = ArithmeticTask(op, min_operand, max_operand)
    problems = task.source(seed)  # random.seed(42) + generate_problem(), as the script
    clock = time.perf_counter
    run = QuickstartRun()
    service_client = mint.ServiceClient(api_key=api_key, base_url=base_url)
    try:
        service_client.get_server_capabilities()
        training_client = service_client.create_lora_training_client(
            base_model=base_model, rank=rank, seed=lora_seed
        )
        tokenizer = training_client.get_tokenizer()
        cpu_started = process_cpu_seconds()
        run.started = clock()
        for step in range(1, steps + 1):
            step_start = clock()
            spans: list[Span] = []
            sampling_client = training_client.save_weights_and_get_sampling_client()
            spans.append(Span(step, "snapshot", step_start, clock()))
            training_datums: list[types.Datum] = []
            all_breakdowns: list[RewardBreakdown] = []
            questions: list[str] = []
            tokens = 0
            for _ in range(batch):
                problem = problems.next()
                questions.append(problem.question)
                prompt_tokens = list(tokenizer.encode(task.prompt(problem)))
                t0 = clock()
                result = sampling_client.sample(
                    prompt=types.ModelInput.from_ints(tokens=prompt_tokens),
                    num_samples=group,
                    sampling_params=types.SamplingParams(
                        max_tokens=max_tokens, temperature=temperature, seed=sampling_seed
                    ),
                ).result()
                t1 = clock()
                spans.append(Span(step, "sample", t0, t1))
                group_rewards: list[float] = []
                group_sequences: list[list[int]] = []
                group_logprobs: list[list[float]] = []
                for seq in result.sequences:
                    response_tokens = list(seq.tokens)
                    response_text = tokenizer.decode(response_tokens)
                    breakdown = task.score(response_text, problem)
                    group_rewards.append(breakdown.total)
                    group_sequences.append(response_tokens)
                    group_logprobs.append(list(seq.logprobs or [0.0] * len(response_tokens)))
                    all_breakdowns.append(breakdown)
                    tokens += len(response_tokens)
                mean_reward = sum(group_rewards) / len(group_rewards)
                advantages = [r - mean_reward for r in group_rewards]
                for response_tokens, logprobs, advantage in zip(
                    group_sequences, group_logprobs, advantages, strict=True
                ):
                    if not response_tokens or abs(advantage) < _ADVANTAGE_EPSILON:
                        continue
                    training_datums.append(
                        _datum(prompt_tokens, response_tokens, logprobs, advantage)
                    )
                spans.append(Span(step, "score", t1, clock()))
            if training_datums:
                t0 = clock()
                training_client.forward_backward(
                    training_datums, loss_fn="importance_sampling"
                ).result()
                training_client.optim_step(types.AdamParams(learning_rate=lr)).result()
                spans.append(Span(step, "train", t0, clock()))
            step_end = clock()
            line = _summary_line(step, all_breakdowns, len(training_datums))
            if echo is not None:
                echo(line)
            run.lines.append(line)
            run.datums.append(training_datums)
            run.questions.append(questions)
            run.steps.append(
                _step_record(
                    step, step_start, step_end, spans, batch * group, tokens, len(training_datums)
                )
            )
        run.finished = clock()
        run.cpu_s = process_cpu_seconds() - cpu_started
        final = training_client.save_weights_for_sampler(name="custom-reward-final").result()
        run.saved_path = str(final.path)
        if echo is not None:
            echo(f"\nSaved: {run.saved_path}")
    finally:
        service_client.holder.close()  # stops the SDK's heartbeat for this session
    return run


def _step_record(
    step: int,
    start: float,
    end: float,
    spans: list[Span],
    samples: int,
    tokens: int,
    datums: int,
) -> QuickstartStep:
    def busy(stage: str) -> float:
        return sum(s.seconds for s in spans if s.stage == stage)

    return QuickstartStep(
        step=step,
        start=start,
        end=end,
        snapshot_s=busy("snapshot"),
        sample_s=busy("sample"),
        score_s=busy("score"),
        train_s=busy("train"),
        samples=samples,
        tokens=tokens,
        datums=datums,
        spans=tuple(spans),
    )
