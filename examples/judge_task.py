"""A judge reward against the local server: the model being trained is graded by a
second, frozen model on the same server (its base model, through a MinT sampling client).

The packaged model only does ``a + b`` in the quickstart's format and answers nothing
else (empty strings), so it cannot read a grading rubric. Here the judge is asked the
question itself and the verdict compares its answer with the response: a reference-free
judge whose cost (``judge/calls``, ``judge/cache_hits``, tokens) shows in every step's
metrics. With a chat model (``--local-model smollm2-135m``) or any OpenAI-compatible
endpoint (``OpenAIJudgeModel``), use ``DEFAULT_RUBRIC`` and the ``SCORE:`` verdict.

    python examples/judge_task.py --steps 3
"""

from __future__ import annotations

import argparse
import asyncio

import mint
from transformers import AutoTokenizer

from engine import Engine, EngineConfig
from engine.local import ServerConfig, serve_local
from engine.tasks import ArithmeticTask
from engine.tasks.judge import Judge, JudgedTask, MintJudgeModel
from engine.tasks.judge_task import ANSWER_THE_QUESTION, same_number


async def main(steps: int) -> None:
    async with serve_local(ServerConfig()) as server:
        # The constructor blocks on the server, which answers on this event loop.
        service = await asyncio.to_thread(
            mint.ServiceClient, api_key="tml-example", base_url=server.base_url
        )
        sampler = await service.create_sampling_client_async(base_model=server.model_name)
        tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
        # chat=False: the judge reads the task's prompt as the trained model does (the
        # packaged model's chat template would wrap it in a second "Question: ...").
        model = MintJudgeModel(sampler, tokenizer, chat=False)
        judge = Judge(model, ANSWER_THE_QUESTION, verdict=same_number, max_tokens=8)
        task = JudgedTask(ArithmeticTask(op="+", min_operand=10, max_operand=99), judge)
        config = EngineConfig(
            base_url=server.base_url,
            api_key="tml-example",
            steps=steps,
            batch=4,
            group=4,
            max_tokens=8,
            progress=False,
        )
        async with Engine(config, task=task) as engine:
            result = await engine.run()
        print(f"judge cost: {judge.metrics()}")
        print(f"run dir: {result.run_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    asyncio.run(main(parser.parse_args().steps))
