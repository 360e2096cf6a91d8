"""A faithful re-implementation of the MinT quickstart ``custom_reward.py`` loop.

Same SDK calls in the same order (sync forms, one after another): a new sampler snapshot
per step, each problem drawn and sampled in turn, advantages = reward - group mean,
datums skipped when the response is empty or |advantage| < 1e-12, then
``forward_backward(...).result()`` and only then ``optim_step(...).result()``; the same
per-step line and ``Saved:`` path. The knobs the quickstart reads from the environment
are parameters here, plus two test-only seeds (LoRA init, sampling) that make two runs
comparable; with them unset the SDK calls are exactly the quickstart's.

It is the yardstick of the engine's K=0 mode: tests compare the datums each sends.
The reward and datum code is written out again here on purpose (not imported from the
engine), so a bug in the engine's copy cannot hide.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import mint
from mint import types


@dataclass
class ReferenceRun:
    lines: list[str] = field(default_factory=list)
    datums: list[list[types.Datum]] = field(default_factory=list)  # per step, as sent
    questions: list[list[str]] = field(default_factory=list)  # per step
    saved_path: str = ""


def _extract_prediction(response: str) -> int | None:
    match = re.search(r"-?\d+", response)
    return int(match.group()) if match else None


def _reward(response: str, answer: int) -> tuple[float, float, float, float]:
    prediction = _extract_prediction(response)
    if prediction is None:
        return 0.0, 0.0, 0.0, 0.0
    fmt = 0.2
    error = abs(prediction - answer)
    scale = max(abs(answer), 20)
    distance = 0.5 * max(0.0, 1.0 - min(error / scale, 1.0))
    exact = 0.3 if prediction == answer else 0.0
    return min(1.0, fmt + distance + exact), fmt, distance, exact


def _datum(
    prompt: list[int], response: list[int], logprobs: list[float], adv: float
) -> types.Datum:
    prefix_len = len(prompt) - 1
    full = prompt + response
    n = len(response)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "weights": [0.0] * prefix_len + [1.0] * n,
            "logprobs": [0.0] * prefix_len + logprobs,
            "advantages": [0.0] * prefix_len + [adv] * n,
        },
    )


def run_quickstart_reference(
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
) -> ReferenceRun:
    """Run the quickstart loop against ``base_url``; return what it printed and sent."""
    rng = random.Random(seed)  # the quickstart: random.seed(42) at import
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    run = ReferenceRun()
    service_client = mint.ServiceClient(api_key=api_key, base_url=base_url)
    try:
        service_client.get_server_capabilities()
        training_client = service_client.create_lora_training_client(
            base_model=base_model,
            rank=rank,
            seed=lora_seed,
            train_mlp=True,
            train_attn=True,
            train_unembed=True,
        )
        tokenizer = training_client.get_tokenizer()
        for step in range(1, steps + 1):
            sampling_client = training_client.save_weights_and_get_sampling_client()
            training_datums: list[types.Datum] = []
            rewards_all: list[tuple[float, float, float, float]] = []
            questions: list[str] = []
            for _ in range(batch):
                a = rng.randint(min_operand, max_operand)
                b = rng.randint(min_operand, max_operand)
                question, answer = f"What is {a} {op} {b}?", apply(a, b)
                questions.append(question)
                prompt_tokens = tokenizer.encode(f"Question: {question}\nAnswer:")
                result = sampling_client.sample(
                    prompt=types.ModelInput.from_ints(tokens=prompt_tokens),
                    num_samples=group,
                    sampling_params=types.SamplingParams(
                        max_tokens=max_tokens, temperature=temperature, seed=sampling_seed
                    ),
                ).result()
                group_rewards: list[float] = []
                group_sequences: list[list[int]] = []
                group_logprobs: list[list[float]] = []
                for seq in result.sequences:
                    response_tokens = list(seq.tokens)
                    breakdown = _reward(tokenizer.decode(response_tokens), answer)
                    group_rewards.append(breakdown[0])
                    group_sequences.append(response_tokens)
                    group_logprobs.append(list(seq.logprobs or [0.0] * len(response_tokens)))
                    rewards_all.append(breakdown)
                mean_reward = sum(group_rewards) / len(group_rewards)
                advantages = [r - mean_reward for r in group_rewards]
                for response_tokens, logprobs, advantage in zip(
                    group_sequences, group_logprobs, advantages, strict=True
                ):
                    if not response_tokens or abs(advantage) < 1e-12:
                        continue
                    training_datums.append(
                        _datum(prompt_tokens, response_tokens, logprobs, advantage)
                    )
            if training_datums:
                training_client.forward_backward(
                    training_datums, loss_fn="importance_sampling"
                ).result()
                training_client.optim_step(types.AdamParams(learning_rate=lr)).result()
            count = len(rewards_all)
            avg = sum(r[0] for r in rewards_all) / count
            exact_rate = sum(1 for r in rewards_all if r[3] > 0) / count
            format_rate = sum(1 for r in rewards_all if r[1] > 0) / count
            run.lines.append(
                f"Step {step}: avg_reward={avg:.3f}, exact_rate={exact_rate:.1%}, "
                f"format_rate={format_rate:.1%}, datums={len(training_datums)}"
            )
            run.datums.append(training_datums)
            run.questions.append(questions)
        final = training_client.save_weights_for_sampler(name="custom-reward-final").result()
        run.saved_path = final.path
    finally:
        service_client.holder.close()
    return run
