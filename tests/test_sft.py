"""Supervised fine-tuning (``--objective sft``) below the session seam: conversations
rendered turn by turn, weights on the assistant tokens only, the pipeline's steps
exactly once, resume continuing the data cursor, the held-out loss. On the fake
session (tests/fake_session.py); the real run is in tests/test_engine_sft.py."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_session import ByteTokenizer, FakeSession
from test_pipeline_stages import config
from transformers import AutoTokenizer

from engine import Engine, EngineConfig
from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
from engine.catalog import load_task
from engine.core.datums import supervised_datums
from engine.core.problems import Problem
from engine.core.trajectory import Trajectory
from engine.errors import ConfigError
from engine.loop.groups import NotSampled
from engine.loop.results import StepResult
from engine.loop.sft_stage import ConversationPlan
from engine.rollouts import main as rollouts_main
from engine.run import parse_config
from engine.tasks.conversations import ConversationTask
from engine.tasks.render import PromptRenderer

pytestmark = pytest.mark.anyio


class ChatByteTokenizer(ByteTokenizer):
    """Byte tokens and a chat template that writes ``<role>content|`` per message."""

    chat_template = "<role>content|"

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
        **options: Any,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclasses.dataclass
class ChatSession(FakeSession):
    @property
    def tokenizer(self) -> ChatByteTokenizer:  # type: ignore[override]
        return ChatByteTokenizer()


def conversations(path: Path, count: int) -> Path:
    with path.open("w") as f:
        for i in range(count):
            messages = [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ok"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def sft_config(run_dir: Path, data: Path, **changes: Any) -> EngineConfig:
    return config(
        task=f"jsonl:{data}",
        objective="sft",
        run_dir=run_dir,
        checkpoint_every=1,
        progress=False,
        **changes,
    )


async def run(
    cfg: EngineConfig, session: FakeSession, console: io.StringIO | None = None
) -> list[StepResult]:
    steps: list[StepResult] = []
    async with Engine(cfg, session=session, on_step=steps.append, console=console) as engine:
        await engine.run()
    return steps


def test_only_the_assistant_tokens_of_a_conversation_are_weighted(tmp_path: Path) -> None:
    task = ConversationTask(conversations(tmp_path / "c.jsonl", 1))
    plan = ConversationPlan(task, PromptRenderer(task, ChatByteTokenizer()), None)
    problem = task.source(0).next()
    assert problem is not None
    built = plan.build(problem, 0)
    assert isinstance(built, Trajectory)
    [datum] = supervised_datums(built)
    assert set(datum.loss_fn_inputs) == {"target_tokens", "weights"}
    targets = bytes(datum.loss_fn_inputs["target_tokens"].tolist()).decode()
    weighted = "".join(
        c for c, w in zip(targets, datum.loss_fn_inputs["weights"], strict=True) if w == 1.0
    )
    assert weighted == "a0|ok|"  # each assistant message and the end the template writes
    assert set(np.unique(datum.loss_fn_inputs["weights"]).tolist()) == {0.0, 1.0}


def test_a_conversation_without_an_assistant_message_is_refused_naming_its_line(
    tmp_path: Path,
) -> None:
    data = conversations(tmp_path / "c.jsonl", 2)
    with data.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"c\.jsonl:3: the conversation has no assistant"):
        load_task(f"jsonl:{data}", objective="sft")


def test_a_conversation_that_starts_with_the_assistant_is_refused_naming_its_line(
    tmp_path: Path,
) -> None:
    """Refused as the task is loaded (exit 2 before a server starts), not a ValueError
    from the chat template ("empty conversation") once the run has begun."""
    data = conversations(tmp_path / "c.jsonl", 2)
    opening = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    with data.open("a") as f:
        f.write(json.dumps({"messages": [*opening, {"role": "assistant", "content": "ok"}]}))
    with pytest.raises(
        ConfigError, match=r"c\.jsonl:3: the conversation starts with an assistant message"
    ):
        load_task(f"jsonl:{data}", objective="sft")
    # a system message first (--task-arg system=...) gives the assistant a context
    task = load_task(f"jsonl:{data}", {"system": "be brief"}, objective="sft")
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    plan = ConversationPlan(task, PromptRenderer(task, tokenizer), None)
    assert all(isinstance(plan.build(p, 0), Trajectory) for p in _all_problems(task, 3))


def _all_problems(task: Any, count: int) -> list[Problem]:
    source = task.source(0)
    problems = [source.next() for _ in range(count)]
    assert all(p is not None for p in problems)
    return problems


class CountingTokenizer:
    """The packaged model's tokenizer, recording the length of every text it encodes."""

    def __init__(self) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
        self.encoded: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        return list(self._tokenizer.encode(text, **kwargs))


def test_a_conversation_far_over_the_context_is_dropped_before_it_is_tokenized(
    tmp_path: Path,
) -> None:
    """A 4 MB message under a 256-token context is dropped as a conversation over the
    context is, without a token of it computed (a 50 MB line took 10 GB and minutes)."""
    context = 256
    huge = "1+2=3 " * 700_000
    rows = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q " * 400}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": huge}, {"role": "assistant", "content": "a"}],
    ]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    task = ConversationTask(data, shuffle=False)
    tokenizer = CountingTokenizer()
    plan = ConversationPlan(task, PromptRenderer(task, tokenizer), context)
    fits, over, far_over = (plan.build(p, 0) for p in _all_problems(task, 3))
    assert isinstance(fits, Trajectory)
    assert isinstance(over, NotSampled) and isinstance(far_over, NotSampled)
    assert over.reason.endswith(f"exceeds the model's context of {context} tokens")
    chars = re.fullmatch(
        rf"conversation 2 of (\d+) characters exceeds the model's context of {context} "
        r"tokens \(at most \d+ characters fit in it\)",
        far_over.reason,
    )
    assert chars is not None and int(chars[1]) > len(huge)
    assert max(tokenizer.encoded) < 10_000  # the small conversations only


def test_sft_refuses_a_task_without_conversations(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--objective sft trains on conversations"):
        from engine.engine import prepare_run

        prepare_run(config(objective="sft", run_dir=tmp_path / "run"), None)


async def test_sft_trains_each_step_once_with_cross_entropy_and_no_sampling(
    tmp_path: Path,
) -> None:
    session = ChatSession()
    cfg = sft_config(tmp_path / "run", conversations(tmp_path / "c.jsonl", 20))
    console = io.StringIO()
    steps = await run(cfg, session, console)
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert {loss.name for loss in session.losses} == {"cross_entropy"}
    # Each step's second console line is the objective's (sft's: groups, summed loss).
    assert console.getvalue().count("\n  groups=2/2 loss:sum=") == 4
    assert [e for e in session.log if e[0] in ("sample", "snapshot")] == []
    ids = [g.problem.id for s in steps for g in s.groups]
    assert ids == list(range(8))  # batch 2: every conversation drawn once, in order
    for s in steps:
        rows = [g.problem.data["row"] for g in s.groups]
        assert s.metrics["sft/tokens"] == sum(len(f"a{row}|ok|") for row in rows)
        assert s.metrics["sft/loss"] == pytest.approx(0.5)  # the fake's logprob -0.5
        assert s.line.startswith(f"Step {s.step}: sft/loss=0.5000")


async def test_a_resumed_sft_run_continues_the_data_cursor(tmp_path: Path) -> None:
    data = conversations(tmp_path / "c.jsonl", 20)
    session = ChatSession()
    cfg = sft_config(tmp_path / "run", data, steps=6)
    whole = await run(sft_config(tmp_path / "whole", data, steps=6), ChatSession())
    first: list[StepResult] = []
    async with Engine(cfg, session=session, on_step=first.append) as engine:

        async def stop_after_two(result: StepResult) -> None:
            if result.step == 2:
                engine.request_stop()

        engine.add_step_hook(stop_after_two)
        result = await engine.run()
    assert result.stopped
    second = await run(cfg.replace(resume=tmp_path / "run"), session)
    trained = [g.problem.data["row"] for s in first + second for g in s.groups]
    assert [s.step for s in first + second] == [s.step for s in whole]
    assert trained == [g.problem.data["row"] for s in whole for g in s.groups]


async def test_epochs_end_an_sft_run_when_the_data_is_spent(tmp_path: Path) -> None:
    data = conversations(tmp_path / "c.jsonl", 3)
    cfg = sft_config(tmp_path / "run", data, steps=10, task_args={"epochs": "2"})
    steps = await run(cfg, ChatSession())
    assert len(steps) == 3  # 6 conversations, batch 2
    rows = sorted(g.problem.data["row"] for s in steps for g in s.groups)
    assert rows == [0, 0, 1, 1, 2, 2]


async def test_the_held_out_loss_is_measured_at_the_start_and_every_n_steps(
    tmp_path: Path,
) -> None:
    data = conversations(tmp_path / "c.jsonl", 20)
    cfg = sft_config(tmp_path / "run", data, eval_every=2, task_args={"eval_size": "4"})
    steps = await run(cfg, ChatSession())
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").open()]
    assert [r["step"] for r in records] == [0, 2, 4]
    losses = [r["eval/sft/loss"] for r in records]
    assert losses == sorted(losses, reverse=True) and losses[0] > losses[-1]
    assert all(r["eval/sft/conversations"] == 4 for r in records)
    assert "eval/sft/loss" in steps[1].metrics and "eval/sft/loss" not in steps[0].metrics
    task = ConversationTask(data, eval_size=4)
    held_out = {p.data["row"] for p in task.eval_problems()}
    assert not held_out & {g.problem.data["row"] for s in steps for g in s.groups}


async def test_a_lost_sft_step_is_restored_and_redone_once(tmp_path: Path) -> None:
    session = ChatSession(fail_step=3)
    cfg = sft_config(tmp_path / "run", conversations(tmp_path / "c.jsonl", 20))
    steps = await run(cfg, session)
    assert ("failed", 3) in session.log and ("restore", 2) in session.log
    final = {s.step: s for s in steps}  # the redone step replaces the lost one
    assert sorted(final) == [1, 2, 3, 4]
    ids = [g.problem.id for step in sorted(final) for g in final[step].groups]
    assert ids == list(range(8))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_hf_conversations_train_with_a_held_out_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")

    def split(count: int, start: int) -> Any:
        return datasets.Dataset.from_list(
            [
                {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"a{i}"},
                    ]
                }
                for i in range(start, start + count)
            ]
        )

    path = tmp_path / "saved"
    datasets.DatasetDict({"train": split(6, 0), "test": split(2, 100)}).save_to_disk(str(path))
    task = load_task(f"hf:{path}", {"eval_split": "test"}, objective="sft")
    assert isinstance(task, ConversationTask)
    assert [p.answer for p in task.eval_problems()] == ["a100", "a101"]
    assert task.spec == (f"hf:{path.resolve()}", {"eval_split": "test"})
    with pytest.raises(ConfigError, match="unknown task argument 'reward' for --objective sft"):
        load_task(f"hf:{path}", {"reward": "exact"}, objective="sft")


def test_the_shipped_sft_example_config_loads() -> None:
    root = Path(__file__).resolve().parents[1]
    cfg = parse_config(["--config", str(root / "examples" / "sft_repeat.toml")], {})
    assert (cfg.training.objective, cfg.pipeline.steps, cfg.evaluation.eval_every) == (
        "sft",
        60,
        20,
    )
    task = load_task(
        f"jsonl:{root / 'examples' / 'sft_repeat.jsonl'}",
        cfg.task.args,
        objective=cfg.training.objective,
    )
    assert isinstance(task, ConversationTask) and len(task.eval_problems()) == 100


async def test_an_sft_runs_rollouts_print_each_conversation_as_trained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await run(sft_config(tmp_path / "run", conversations(tmp_path / "c.jsonl", 8)), ChatSession())
    assert rollouts_main([str(tmp_path / "run"), "--step", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    head, context, first, then, second = out[:5]
    assert head.startswith("step 1 - conversation ")
    row = context.removeprefix("  context: '<user>q").removesuffix("|<assistant>'")
    assert first == f"  trained [{len(row) + 2} tok]: 'a{row}|'"  # the message and its end
    assert then == "  then: '<user>more|<assistant>'"  # what the context added to it
    assert second == "  trained [3 tok]: 'ok|'"
    assert not any("reward" in line or "adv" in line for line in out)
