"""A few RL steps of a chat-template task on the opt-in pretrained model, through the
unmodified SDK against a local server; prints the time of each step's stages.

    pip install 'engine[smollm2]'
    python -m benchmarks.chat_rl --steps 3 --batch 4 --group 4 --max-tokens 16

Each step: for ``batch`` problems "What is a + b?" (rendered with the model's chat
template), sample ``group`` answers, reward 1 for the exact sum (0.1 for another
number), advantages = reward - group mean, one importance_sampling forward_backward +
optim_step, then a new sampler snapshot. Timings are wall-clock seconds on this machine's CPUs.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import dataclass

import mint
from mint import types

from engine.local import LocalServer


@dataclass(frozen=True)
class StepTiming:
    step: int
    sample_s: float
    train_s: float
    snapshot_s: float
    mean_reward: float
    loss: float

    @property
    def total_s(self) -> float:
        return self.sample_s + self.train_s + self.snapshot_s


def chat_rl(
    server: LocalServer, *, steps: int, batch: int, group: int, max_tokens: int, seed: int = 0
) -> list[StepTiming]:
    service = mint.ServiceClient(base_url=server.base_url, api_key="tml-chat-rl")
    training = service.create_lora_training_client(base_model=server.model_name, rank=8, seed=seed)
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client()
    rng = random.Random(seed)
    timings = []
    for step in range(steps):
        problems = [(rng.randint(10, 49), rng.randint(10, 49)) for _ in range(batch)]
        started = time.perf_counter()
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
                add_generation_prompt=True,
                tokenize=True,
            )
            for a, b in problems
        ]
        prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + step)
        futures = [
            sampler.sample(types.ModelInput.from_ints(list(p)), group, params) for p in prompts
        ]
        answers = [f.result() for f in futures]
        sampled = time.perf_counter()
        data, rewards = [], []
        for (a, b), prompt, answer in zip(problems, prompts, answers, strict=True):
            scores = [_reward(tokenizer.decode(seq.tokens), a + b) for seq in answer.sequences]
            rewards += scores
            mean = sum(scores) / len(scores)
            for seq, score in zip(answer.sequences, scores, strict=True):
                if score == mean or not seq.tokens:
                    continue
                tokens = list(prompt) + list(seq.tokens)
                n_prompt = len(prompt)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs or []),
                            "advantages": [0.0] * (n_prompt - 1) + [score - mean] * len(seq.tokens),
                        },
                    )
                )
        loss = 0.0
        if data:
            fb = training.forward_backward(data, "importance_sampling")
            optim = training.optim_step(types.AdamParams(learning_rate=1e-4))
            loss = fb.result().metrics["loss:sum"]
            optim.result()
        trained = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client()
        done = time.perf_counter()
        timings.append(
            StepTiming(
                step,
                sampled - started,
                trained - sampled,
                done - trained,
                sum(rewards) / len(rewards),
                loss,
            )
        )
    return timings


def _reward(text: str, answer: int) -> float:
    """1 for the exact sum, 0.1 for another number, 0 for no number."""
    found = re.search(r"-?\d+", text)
    if found is None:
        return 0.0
    return 1.0 if int(found.group()) == answer else 0.1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chat_rl", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    args = parser.parse_args()
    with LocalServer(args.model, num_threads=args.threads) as server:
        print(f"model {server.model_name}; batch {args.batch} x group {args.group}")
        for t in chat_rl(
            server,
            steps=args.steps,
            batch=args.batch,
            group=args.group,
            max_tokens=args.max_tokens,
        ):
            print(
                f"step {t.step}: total {t.total_s:.2f} s (sample {t.sample_s:.2f}, train "
                f"{t.train_s:.2f}, snapshot {t.snapshot_s:.2f}); mean reward "
                f"{t.mean_reward:.2f}, loss {t.loss:.3f}"
            )


if __name__ == "__main__":
    main()
