"""Real tasks below the seam: prompt rendering, stop strings, the dataset task's cursor
and reward presets, task arguments and config files (no server)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.catalog import load_task, task_spec
from engine.config import EngineConfig, parse_task_args, read_config_file
from engine.config.values import parse_score_workers
from engine.envs.scoring import RewardError, Scorer
from engine.errors import ConfigError
from engine.run import main, parse_config
from engine.session.preflight import local_server_profile
from engine.tasks import ArithmeticTask, Problem
from engine.tasks.dataset import DatasetTask, raw_prompts_warning
from engine.tasks.judge import Judge, JudgedTask, OpenAIJudgeModel
from engine.tasks.render import PromptRenderer, render_prompt
from engine.tasks.rewards import make_reward
from scripts import make_model

SHIPPED = make_model.DEFAULT_OUT


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def addition_rows(n: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(
            {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b}
        )
    return rows


# ----------------------------------------------------------------------------- rendering


def test_shipped_chat_template_renders_the_trained_format(tokenizer: Any) -> None:
    chat = render_prompt(tokenizer, [{"role": "user", "content": "What is 12 + 34?"}])
    assert chat == tokenizer.encode("Question: What is 12 + 34?\nAnswer:")
    assert render_prompt(tokenizer, "raw text") == tokenizer.encode("raw text")


def test_make_model_writes_the_chat_template_into_tokenizer_config(tmp_path: Path) -> None:
    make_model.build_tokenizer().save_pretrained(tmp_path, save_jinja_files=False)
    built = json.loads((tmp_path / "tokenizer_config.json").read_text())
    shipped = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert built == shipped
    assert shipped["chat_template"] == make_model.CHAT_TEMPLATE


def test_chat_template_options_reach_the_template(tokenizer: Any) -> None:
    class Recording:
        chat_template = "x"

        def __init__(self) -> None:
            self.kwargs: dict[str, Any] = {}

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            self.kwargs = kwargs
            return "rendered"

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(text), int(add_special_tokens)]

    tok = Recording()
    ids = render_prompt(tok, [{"role": "user", "content": "hi"}], {"enable_thinking": False})
    assert ids == [len("rendered"), 0]  # the template writes the special tokens
    assert tok.kwargs == {
        "tokenize": False,
        "add_generation_prompt": True,
        "enable_thinking": False,
    }


def test_chat_prompt_without_a_template_is_a_config_error() -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(ConfigError, match="has no chat template"):
        render_prompt(NoTemplate(), [{"role": "user", "content": "hi"}])


class _StopTask:
    name = "stops"
    stop = ("\n", "Question:")
    skip_special_tokens = True

    def __init__(self) -> None:
        self.context: Any = None

    def setup(self, context: Any) -> None:
        self.context = context


def test_renderer_stop_strings_decoding_and_setup(tokenizer: Any) -> None:
    task = _StopTask()
    renderer = PromptRenderer(task, tokenizer)
    assert task.context is renderer.context and task.context.tokenizer is tokenizer
    assert renderer.stops(stop_at_eos=False) == (("\n", "Question:"), ())
    assert renderer.stops(stop_at_eos=True) == (("\n", "Question:", "</s>"), ())
    tokens = tokenizer.encode(" 46\nQuestion: x", add_special_tokens=False)
    assert renderer.decode([*tokens, tokenizer.eos_token_id]) == " 46"
    plain = PromptRenderer(ArithmeticTask(), tokenizer)  # no stop strings
    assert plain.stops(stop_at_eos=False) == ((), ())
    assert plain.stops(stop_at_eos=True) == ((), (tokenizer.eos_token_id,))


def test_a_reward_sees_the_response_without_its_end_token(tokenizer: Any) -> None:
    """The packaged model ends ' 7' with '</s>': the text a reward compares with ``==``
    stops before it (and before anything sampled past it); --keep-stop-text keeps the
    quickstart's decoding."""
    seven = tokenizer.encode(" 7", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    plain = PromptRenderer(ArithmeticTask(), tokenizer)
    assert plain.decode([*seven, eos]) == " 7"
    assert plain.decode([*seven, eos, *seven]) == " 7"
    assert plain.decode(tokenizer.encode(" 7</s>", add_special_tokens=False)) == " 7"
    kept = PromptRenderer(ArithmeticTask(), tokenizer, keep_stop_text=True)
    assert kept.decode([*seven, eos]) == " 7</s>"
    judged = JudgedTask(ArithmeticTask(), Judge(OpenAIJudgeModel("http://judge.test/v1", "m")))
    assert PromptRenderer(judged, tokenizer).decode([*seven, eos]) == " 7"  # what a judge reads
    context = plain.context
    assert context.response_text([*seven, *seven], (), stop_token_ids=(seven[0],)) == ""


# ----------------------------------------------------------------------------- dataset


def drawn(task: DatasetTask, seed: int, n: int, state: Any = None) -> list[Any]:
    source = task.source(seed, state)
    out = []
    for _ in range(n):
        p = source.next()
        out.append(None if p is None else (p.id, p.data["row"], p.data["epoch"]))
    return out


def test_dataset_cursor_shuffles_per_epoch_and_resumes_exactly(tmp_path: Path) -> None:
    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", addition_rows(10)), epochs=3)
    whole = drawn(task, 5, 31)
    assert whole[-1] is None  # 3 epochs of 10 rows, then the source ends
    epochs = [[r for _, r, e in whole[:30] if e == k] for k in range(3)]
    assert all(sorted(rows) == list(range(10)) for rows in epochs)  # each row once per epoch
    assert epochs[0] != epochs[1]  # reshuffled
    assert drawn(task, 5, 30) == whole[:30]  # seeded
    assert drawn(task, 6, 10) != whole[:10]
    source = task.source(5)
    for _ in range(13):  # mid-epoch 2
        source.next()
    state = json.loads(json.dumps(source.state()))  # as a checkpoint stores it
    assert drawn(task, 5, 18, state) == whole[13:31]


def test_dataset_held_out_split_is_disjoint_and_fixed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", addition_rows(40))
    a = DatasetTask.from_args(str(path), {"eval_size": "10"})
    b = DatasetTask.from_args(str(path), {"eval_size": "10"})
    held = [p.data["row"] for p in a.eval_problems()]
    assert held == [p.data["row"] for p in b.eval_problems()] and len(held) == 10
    train = {r for _, r, _ in drawn(a, 1, 30)}
    assert train.isdisjoint(held) and len(train) == 30
    problem = a.eval_problems()[0]
    assert a.prompt(problem) == addition_rows(40)[problem.data["row"]]["messages"]


def test_dataset_field_mapping_system_prompt_and_string_prompts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"q": "2+2?", "gold": "4"}, {"q": "3+3?", "gold": 6}])
    raw = DatasetTask.from_args(str(path), {"prompt_field": "q", "answer_field": "gold"})
    first = raw.source(0).next()
    assert first is not None and isinstance(raw.prompt(first), str)
    chat = DatasetTask.from_args(
        str(path), {"prompt_field": "q", "answer_field": "gold", "system": "Be brief."}
    )
    p = chat.source(0).next()
    assert p is not None
    assert chat.prompt(p) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": p.question},
    ]
    assert chat.score(f" {p.answer} ", p).total == 1.0


def test_string_prompts_sent_raw_to_a_chat_model_are_named_with_the_fix(
    tmp_path: Path, tokenizer: Any
) -> None:
    """Plain-string prompts are sent raw unless chat=true; when the served model has a
    chat template and chat was not set, the run is told so (chat=false: raw, quietly)."""
    strings = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "What is 2 + 3?", "answer": 5}] * 3)
    chats = write_jsonl(tmp_path / "c.jsonl", addition_rows(3))

    def warning(path: Path, args: dict[str, str], tok: Any = tokenizer) -> str | None:
        return raw_prompts_warning(load_task(f"jsonl:{path}", args), tok)

    said = warning(strings, {})
    assert said is not None and "plain strings, sent raw" in said
    assert "--task-arg chat=true" in said and "chat=false" in said
    assert warning(strings, {"chat": "false"}) is None
    assert warning(strings, {"chat": "true"}) is None
    assert warning(strings, {"system": "Be brief."}) is None  # (a system message: chat)
    assert warning(chats, {}) is None
    no_template = type("Plain", (), {"chat_template": None})()
    assert warning(strings, {}, no_template) is None
    assert raw_prompts_warning(ArithmeticTask(), tokenizer) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"reward": "fuzzy"}, "unknown reward 'fuzzy'"),
        ({"colour": "red"}, "unknown task argument 'colour'"),
        ({"epochs": "many"}, "epochs must be an integer"),
        ({"shuffle": "maybe"}, "shuffle must be true or false"),
        ({"eval_size": "99"}, "eval_size must be in 0..3"),
        ({"reward": "regex"}, "needs the task argument pattern"),
        ({"prompt_field": "nope"}, "has no prompt field 'nope'"),
    ],
)
def test_dataset_bad_arguments_are_one_line(
    args: dict[str, str], message: str, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", addition_rows(4))
    with pytest.raises(ConfigError, match=message):
        load_task(f"jsonl:{path}", args)


def test_dataset_bad_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        load_task(f"jsonl:{path}")
    with pytest.raises(ConfigError, match="cannot read dataset"):
        load_task(f"jsonl:{tmp_path / 'missing.jsonl'}")


# ----------------------------------------------------------------------------- rewards


def test_reward_presets() -> None:
    exact = make_reward("exact", {})
    assert exact(" Paris. ", "paris").total == 1.0
    assert exact("Paris is", "paris").total == 0.0
    numeric = make_reward("numeric", {"tolerance": "0.01"})
    assert numeric("about 3.14159 I think", 3.14).total == 1.0
    assert numeric("1,000", "1000").total == 1.0
    assert numeric("3.3", 3.14).total == 0.0
    assert numeric("no number", 3).components == {"correct": 0.0}
    regex = make_reward("regex", {"pattern": r"ANSWER:\s*(\w+)"})
    assert regex("so ANSWER: blue", "Blue").total == 1.0
    assert regex("blue", "blue").total == 0.0
    with pytest.raises(ConfigError, match="invalid reward pattern"):
        make_reward("regex", {"pattern": "("})


def test_numeric_reward_reads_the_number_at_the_chosen_position(tmp_path: Path) -> None:
    chatty = "12 + 30: first add the tens, 10 + 30 = 40, then 2 more: 42"
    assert make_reward("numeric", {})(chatty, 42).total == 0.0  # first: 12
    assert make_reward("numeric", {"numeric_position": "first"})("42", 42).total == 1.0
    assert make_reward("numeric", {"numeric_position": "last"})(chatty, 42).total == 1.0
    boxed = make_reward("numeric", {"numeric_position": "boxed"})
    assert boxed(r"7 and 9 give $\boxed{16}$, not 17", 16).total == 1.0
    assert boxed("16", 16).total == 0.0  # no box: no answer
    with pytest.raises(ConfigError, match="numeric_position must be one of first, last, boxed"):
        make_reward("numeric", {"numeric_position": "middle"})
    rows = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12 + 30", "answer": "42"}] * 2)
    task = DatasetTask.from_args(str(rows), {"reward": "numeric", "numeric_position": "last"})
    problem = task.source(0).next()
    assert problem is not None
    assert task.score(chatty, problem).total == 1.0


@pytest.mark.parametrize("workers", ["threads", "processes:1"])
@pytest.mark.anyio
async def test_a_python_reward_scores_a_jsonl_task_sync_or_async(
    tmp_path: Path, workers: str
) -> None:
    """``--task-arg reward=module:function``: the function gets the response and the
    problem; it may be ``async def``, return a bare number or a RewardBreakdown with
    components; the engine's scorer checks what it returns as it checks any reward."""
    rows = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12 + 30", "answer": 42}] * 3)
    for spec, rewards in [
        ("tests.user_tasks:digits_and_answer", [(2.0, {"digits": 1.0, "answer": 1.0})]),
        ("tests.user_tasks:async_answer", [(1.0, {})]),
    ]:
        task = load_task(f"jsonl:{rows}", {"reward": spec})
        assert task_spec(task, f"jsonl:{rows}", {"reward": spec})[1] == {"reward": spec}
        problem = task.source(0).next()
        assert problem is not None
        scorer = Scorer(task, concurrency=2, workers=parse_score_workers(workers))
        (got,) = await scorer.score(problem, ["42"])
        assert [(got.total, dict(got.components))] == rewards
        (miss,) = await scorer.score(problem, ["x"])
        assert miss.total == 0.0
    nan = load_task(f"jsonl:{rows}", {"reward": "tests.user_tasks:not_finite"})
    scorer = Scorer(nan, concurrency=1, workers=parse_score_workers(workers))
    with pytest.raises(RewardError, match="non-finite"):
        await scorer.score(Problem(0, "12 + 30", 42, {"split": "train", "row": 0}), ["42"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:reward", "cannot import 'no_such_module_xyz'"),
        ("tests.user_tasks:no_such_reward", "has no attribute 'no_such_reward'"),
        ("tests.user_tasks:NOT_A_FUNCTION", "is not callable"),
    ],
)
def test_a_python_reward_that_cannot_be_imported_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    rows = write_jsonl(tmp_path / "d.jsonl", addition_rows(4))
    with pytest.raises(ConfigError, match=f"invalid reward '{spec}': .*{message}"):
        load_task(f"jsonl:{rows}", {"reward": spec})
    argv = ["--task", f"jsonl:{rows}", "--task-arg", f"reward={spec}", "--steps", "1"]
    assert main([*argv, "--base-url", "http://127.0.0.1:9", "--api-key", "k"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err and err.count("\n") == 1, err


def test_boxed_reward_with_math_verify() -> None:
    pytest.importorskip("math_verify")
    boxed = make_reward("boxed", {})
    assert boxed(r"so the answer is $\boxed{\frac{1}{2}}$", "0.5").total == 1.0
    assert boxed(r"$\boxed{3}$", "4").total == 0.0


# ----------------------------------------------------------------------------- task args


def test_task_args_reach_the_factory_and_are_recorded() -> None:
    task = load_task("tests.user_tasks:ScaledDigitCountTask", {"scale": "2"})
    assert task.name == "digit-count-x2"
    with pytest.raises(ConfigError, match="calling make_task failed"):
        load_task("tests.user_tasks:make_task", {"weight": "2"})
    assert parse_task_args(["a=1", "b=x=y", "a=2"]) == {"a": "2", "b": "x=y"}
    with pytest.raises(ConfigError, match="--task-arg must be KEY=VALUE"):
        parse_task_args(["novalue"])
    arithmetic = load_task("arithmetic", {"op": "-", "max_operand": "20"})
    assert isinstance(arithmetic, ArithmeticTask) and arithmetic.name == "arithmetic-sub"
    with pytest.raises(ConfigError, match="unknown task argument 'reward'"):
        load_task("arithmetic", {"reward": "exact"})


def test_arithmetic_flags_are_aliases_and_refused_for_user_tasks() -> None:
    cfg = parse_config(["--op", "-", "--task-arg", "max_operand=50"], {})
    local = local_server_profile(None)
    assert cfg.resolved(local).task.args == {"op": "-", "min_operand": "10", "max_operand": "50"}
    with pytest.raises(ConfigError, match="only apply to the arithmetic task"):
        parse_config(["--task", "tests.user_tasks:make_task", "--op", "+"], {})
    user = parse_config(["--task", "tests.user_tasks:make_task"], {}).resolved(local)
    assert user.task.args == {}


def test_task_spec_of_objects() -> None:
    from tests.user_tasks import DigitCountTask

    assert task_spec(ArithmeticTask("+", 1, 9), "arithmetic", {}) == (
        "arithmetic",
        {"op": "+", "min_operand": "1", "max_operand": "9", "eval_size": "0"},
    )
    assert task_spec(DigitCountTask(), "arithmetic", {"op": "+"}) == (
        "tests.user_tasks:DigitCountTask",
        {},
    )
    assert task_spec(DigitCountTask(), "tests.user_tasks:make_task", {"k": "v"}) == (
        "tests.user_tasks:make_task",
        {"k": "v"},
    )


# ----------------------------------------------------------------------------- config files


def test_config_file_sits_under_env_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'steps = 30\nbatch = 4\nlr = 0.001\nmax-tokens = 12\ntask = "arithmetic"\n'
        'stop-at-eos = true\n[task-arg]\nop = "-"\nmax_operand = 40\n'
    )
    cfg = parse_config(["--config", str(path), "--batch", "2", "--task-arg", "op=+"], {})
    assert (
        cfg.pipeline.steps,
        cfg.pipeline.batch,
        cfg.training.learning_rate,
        cfg.sampling.max_tokens,
    ) == (30, 2, 1e-3, 12)
    assert cfg.sampling.stop_at_eos
    assert cfg.task.args == {"op": "+", "max_operand": "40"}
    env = parse_config(["--config", str(path)], {"MINT_CUSTOM_REWARD_STEPS": "5"})
    assert env.pipeline.steps == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "stepz in .* is not a setting"),
        ("steps = 0\n", "steps in .* must be positive"),
        ('steps = "x"\n', "steps in .* must be an integer"),
        ("local = 1\n", "local in .* must be true or false"),
        ('api-key = "sk-123"\n', "keep API keys out of files"),
        ("steps = [\n", "is not valid TOML"),
    ],
)
def test_bad_config_file_is_one_line(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_config_file(path)


def test_bad_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text("stepz = 3\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: stepz in ") and err.count("\n") == 1


def test_init_from_is_checked() -> None:
    with pytest.raises(ConfigError, match="must be a tinker://"):
        parse_config(["--init-from", "/tmp/weights"], {})
    with pytest.raises(ConfigError, match="init_from_optimizer needs init_from"):
        EngineConfig(init_from_optimizer=True)
    cfg = parse_config(["--init-from", "tinker://m-1/weights/final", "--init-from-optimizer"], {})
    assert cfg.model.init_from == "tinker://m-1/weights/final" and cfg.model.init_from_optimizer


def test_problem_ids_are_draw_positions(tmp_path: Path) -> None:
    task = DatasetTask(write_jsonl(tmp_path / "d.jsonl", addition_rows(5)))
    source = task.source(0)
    ids = [p.id for p in (source.next() for _ in range(12)) if isinstance(p, Problem)]
    assert ids == list(range(12))  # unlimited epochs by default


def test_eval_every_needs_held_out_problems_before_anything_starts() -> None:
    from engine.engine import prepare_run

    with pytest.raises(ConfigError, match="--eval-every needs held-out problems"):
        prepare_run(EngineConfig(local=True, eval_every=5, task_args={"eval_size": "0"}), None)
    config, _ = prepare_run(EngineConfig(local=True, eval_every=5), None)  # 64 pairs held out
    assert config.task.args["eval_size"] == "64"
    assert prepare_run(EngineConfig(local=True), None)[0].task.args["eval_size"] == "0"


def test_the_shipped_example_config_loads() -> None:
    root = Path(__file__).resolve().parents[1]
    cfg = parse_config(["--config", str(root / "examples" / "addition_chat.toml")], {})
    assert (cfg.task.spec, cfg.pipeline.steps, cfg.evaluation.eval_every) == (
        "jsonl:examples/addition_chat.jsonl",
        30,
        10,
    )
    assert cfg.task.args == {"eval_size": "100", "reward": "exact"}
    task = load_task(f"jsonl:{root / 'examples' / 'addition_chat.jsonl'}", cfg.task.args)
    assert isinstance(task, DatasetTask) and len(task.eval_problems()) == 100
