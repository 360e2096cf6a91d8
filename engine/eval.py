"""``python -m engine.eval CHECKPOINT``: evaluate a trained checkpoint on a task's held-out
problems, greedily and sampled (mean reward, its components, pass rate, pass@k for a list
of k), with the same evaluator that runs during training
(:func:`engine.loop.evaluation.evaluate_problems`).

CHECKPOINT is a run dir, a checkpoint dir or a ``tinker://`` path
(:mod:`engine.checkpoint_files`). A run dir supplies the task, its arguments and the
sampling settings from its ``config.json``; flags override them. A checkpoint whose files
are here is served by a local server started on a temporary data dir (holding a copy of
it); any other is sampled where it lives (``--base-url`` / ``MINT_BASE_URL``, the run's
``base_url``, with ``MINT_API_KEY``). ``--baseline`` also evaluates the starting weights
(step 0: a fresh LoRA adds nothing to the base model) and prints the difference. The
result is written as JSON (``--out``, default ``<run dir>/eval-<step>.json`` for a run dir):
the metrics and each problem's prompt and responses with their rewards
(:func:`~engine.loop.evaluation.problem_records`); it is printed as a short table.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from engine.basemodels.recommended import LOCAL_TEMPERATURE
from engine.catalog import load_task
from engine.checkpoint_files import CheckpointRef, resolve_checkpoint
from engine.common.cli import OneLineErrorParser, add_version_flag, positive_int, program_name
from engine.common.files import unwritable_reason, write_file_atomically
from engine.common.protocol import LOCAL_MAX_NUM_SAMPLES
from engine.common.setting import parse_text
from engine.config import EngineConfig, parse_task_args
from engine.config.models import setting_at
from engine.config.profile import HOSTED_TEMPERATURE
from engine.config.records import flat_settings
from engine.config.values import pass_k_problem
from engine.envs.scoring import check_score_workers
from engine.errors import ConfigError, EngineError, RunFileError, find_error
from engine.loop.evaluation import eval_problems_of, evaluate_problems, problem_records
from engine.loop.groups import GroupPlan
from engine.rundir.checkpoint_copy import copy_checkpoint_files
from engine.rundir.checkpoint_log import CHECKPOINTS_FILE
from engine.rundir.resume import read_run_config
from engine.session.api import SamplerHandle
from engine.session.opening import open_session
from engine.session.retry import service_guard
from engine.tasks.render import PromptRenderer

if TYPE_CHECKING:
    from engine.session.adapter import SdkSession  # imports the SDK: not for --help

__all__ = ["DEFAULT_SAMPLES", "EvalRequest", "format_table", "main", "run_eval"]

DEFAULT_SAMPLES = 4
"""Sampled responses per problem when neither ``--samples`` nor ``--k`` says."""
MAX_LOCAL_SAMPLES = LOCAL_MAX_NUM_SAMPLES
"""The most sampled responses per problem on the local server: a problem's samples are one
request, and the server draws at most this many per request (its ``max_num_samples``)."""

_FROM_RUN = (
    "task",
    "task_args",
    "base_model",
    "lora_rank",
    "max_tokens",
    "temperature",
    "stop_at_eos",
    "score_concurrency",
    "score_workers",
    "concurrency",
    "on_reward_error",
    "env_max_turns",
    "env_max_tokens",
    "episode_timeout",
    "tool_timeout",
    "on_limit",
    "on_parse_error",
)
"""The settings a run dir's config.json gives the evaluation (flags override them)."""
_STAGED_PATH = ("eval", "weights", "checkpoint")
"""Where a local checkpoint is copied in the temporary data dir (a tinker:// path)."""


@dataclass(frozen=True)
class EvalRequest:
    checkpoint: str
    step: int | None = None
    task: str | None = None
    task_args: Mapping[str, str] | None = None
    samples: int | None = None
    """Sampled responses per problem (None: the largest of ``ks``, else
    :data:`DEFAULT_SAMPLES`)."""
    ks: tuple[int, ...] = ()
    """pass@k for each of these, besides pass@1 and pass@n (each k <= n)."""
    texts: int = 4
    """Sampled responses per problem whose text the JSON keeps (all keep their rewards)."""
    temperature: float | None = None
    max_tokens: int | None = None
    baseline: bool = False
    data_dir: Path | None = None
    base_url: str | None = None

    @property
    def samples_drawn(self) -> int:
        if self.samples is not None:
            return self.samples
        return max(self.ks, default=DEFAULT_SAMPLES)


def _config(request: EvalRequest, ref: CheckpointRef, local: bool) -> EngineConfig:
    stored = read_run_config(ref.run_dir) if ref.run_dir is not None else {}
    recorded = flat_settings(stored)
    settings: dict[str, Any] = {k: recorded[k] for k in _FROM_RUN if recorded.get(k) is not None}
    if settings.get("task_args", {}).get("eval_size") == "0":
        # a run without --eval-every held nothing out: the task's default held-out set
        settings["task_args"] = {k: v for k, v in settings["task_args"].items() if k != "eval_size"}
    if request.task is not None:
        settings["task"] = request.task
        settings["task_args"] = {}
    if request.task_args:
        settings["task_args"] = {**settings.get("task_args", {}), **request.task_args}
    if request.temperature is not None:
        settings["temperature"] = request.temperature
    elif "temperature" not in settings:
        # no run recorded one: the temperature that server recommends for runs
        settings["temperature"] = LOCAL_TEMPERATURE if local else HOSTED_TEMPERATURE
    if request.max_tokens is not None:
        settings["max_tokens"] = request.max_tokens
    if "task" not in settings:
        raise ConfigError(f"{request.checkpoint} is not a run dir: say which task (--task)")
    if local:
        settings["local"] = True
        settings.update(api_key=None, base_url=None)
    elif request.base_url is not None:
        settings["base_url"] = request.base_url
    elif isinstance(recorded.get("base_url"), str):
        settings["base_url"] = recorded["base_url"]
    # eval_every: the arithmetic task then holds out its default number of pairs
    return EngineConfig.from_env(**settings, eval_every=1, steps=1, progress=False).resolved()


def _stage(ref: CheckpointRef, data_dir: Path) -> tuple[str, Path]:
    """Copy a local checkpoint into ``data_dir`` (:func:`copy_checkpoint_files`); return
    the tinker:// path it has there and the copy's directory."""
    assert ref.directory is not None
    copy = data_dir.joinpath(*_STAGED_PATH)
    copy_checkpoint_files(ref.directory, copy, within=ref.root)
    return "tinker://" + "/".join(_STAGED_PATH), copy


@dataclass(frozen=True)
class CheckpointSession:
    """A session open on a checkpoint's service, and where its weights are sampled."""

    session: SdkSession
    sampler_path: str
    step: int

    async def open_sampler(self) -> SamplerHandle:
        return await self.session.open_sampler(self.step, self.sampler_path)


@asynccontextmanager
async def open_checkpoint_session(
    request: EvalRequest, ref: CheckpointRef, *, prefix: str
) -> AsyncIterator[CheckpointSession]:
    """Open a session where ``ref`` (``request.checkpoint`` resolved) can be sampled, with
    the settings its run dir recorded and ``request``'s overrides: a checkpoint whose files
    are here is copied into a temporary data dir (its name starts with ``prefix``) and
    served by a local server there; any other is sampled where it lives. The session's
    ``config`` has the task's arguments completed by what the server says. Shared by
    ``engine.eval`` and ``engine.serve``."""
    local = ref.directory is not None
    config = _config(request, ref, local)
    async with AsyncExitStack() as stack:
        data_dir: Path | None = None
        if local:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
            path, staged = _stage(ref, data_dir)
            if config.session.local_model is None:
                config = _with_base_model_of(config, staged)
        else:
            path = _sampler_path(ref)
        session = await stack.enter_async_context(
            open_session(config, guard=service_guard(config), local_data_dir=data_dir)
        )
        yield CheckpointSession(session, path, ref.step if ref.step is not None else 1)


async def run_eval(request: EvalRequest) -> dict[str, Any]:
    """Evaluate as ``request`` says; return the JSON-able result."""
    samples = request.samples_drawn
    problem = pass_k_problem(request.ks, samples)
    if problem:
        raise ConfigError(f"--k {problem} (--samples {samples})")
    ref = resolve_checkpoint(request.checkpoint, step=request.step, data_dir=request.data_dir)
    local = ref.directory is not None
    if local and samples > MAX_LOCAL_SAMPLES:
        raise ConfigError(
            f"{samples} samples per problem (--samples, or the largest --k) are more than "
            f"the {MAX_LOCAL_SAMPLES} the local server draws per request"
        )
    async with open_checkpoint_session(request, ref, prefix="engine-eval-") as opened:
        session = opened.session
        config = session.config  # the task's arguments completed by what the server says
        task = load_task(config.task.spec, config.task.args)
        check_score_workers(task, config.scoring.score_workers)
        problems = eval_problems_of(task, "engine.eval evaluates a task's held-out problems")
        plan_renderer = PromptRenderer(
            task, session.tokenizer, keep_stop_text=config.sampling.keep_stop_text, session=session
        )
        plan = GroupPlan(config, task, plan_renderer, session.info.max_context)

        async def measure(sampler: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
            evaluation = await evaluate_problems(
                session,
                sampler,
                plan,
                problems,
                max_tokens=config.sampling.max_tokens,
                concurrency=config.pipeline.concurrency,
                samples=samples,
                ks=request.ks,
                temperature=config.sampling.resolved_temperature,
            )
            metrics = {k.removeprefix("eval/"): v for k, v in evaluation.metrics.items()}
            return metrics, problem_records(evaluation, plan_renderer, texts=request.texts)

        metrics, records = await measure(await opened.open_sampler())
        result: dict[str, Any] = {
            "checkpoint": request.checkpoint,
            "tinker_path": ref.tinker_path,
            "step": ref.step,
            "task": task.name,
            "samples": samples,
            "k": sorted({1, samples, *request.ks}) if samples else [],
            "temperature": config.sampling.temperature,
            "max_tokens": config.sampling.max_tokens,
            "metrics": metrics,
            "problems": records,
        }
        if request.baseline:
            pending = await session.submit_snapshot(0)
            baseline, baseline_records = await measure(await session.finish_snapshot(pending))
            result["baseline"] = baseline
            result["baseline_problems"] = baseline_records
            result["difference"] = {k: v - baseline[k] for k, v in metrics.items() if k in baseline}
    return result


def _with_base_model_of(config: EngineConfig, directory: Path) -> EngineConfig:
    """Serve the base model the checkpoint was trained on."""
    from engine.export import base_model_source

    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    source = Path(base_model_source(str(meta.get("base_model", ""))))
    if not (source / "config.json").is_file():
        raise ConfigError(
            f"the checkpoint's base model {meta.get('base_model')!r} is not a local model "
            "the local server can serve"
        )
    return config.replace(local_model=source, base_model=None)


def _sampler_path(ref: CheckpointRef) -> str:
    """A run's checkpoint is sampled from its sampler snapshot, when it recorded one."""
    if ref.run_dir is not None and ref.step is not None:
        for line in (ref.run_dir / CHECKPOINTS_FILE).read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("state_path") == ref.tinker_path and record.get("sampler_path"):
                return str(record["sampler_path"])
    assert ref.tinker_path is not None
    return ref.tinker_path


def _table_keys(metrics: Mapping[str, float]) -> list[str]:
    """Greedy reward, the mean of each reward component (a key with a ``/rate`` beside
    it), pass and success rates, then the sampled reward and pass@k by k."""
    components = sorted(k for k in metrics if f"{k}/rate" in metrics)
    order = ("reward/total", *components, "pass_rate", "success_rate", "sampled/reward/total")
    passes = sorted(
        (k for k in metrics if k.startswith("sampled/pass@")),
        key=lambda k: int(k.rpartition("@")[2]),
    )
    return [k for k in order if k in metrics] + passes


def format_table(result: Mapping[str, Any]) -> str:
    """The result as a short Markdown table (greedy, sampled, and the baseline)."""
    metrics: Mapping[str, float] = result["metrics"]
    keys = _table_keys(metrics)
    baseline: Mapping[str, float] | None = result.get("baseline")
    step = result.get("step")
    columns = [f"step {step}" if step is not None else "checkpoint"]
    if baseline is not None:
        columns = ["step 0", *columns, "difference"]
    lines = [
        f"{result['task']}: {int(metrics.get('problems', 0))} held-out problems, greedy + "
        f"{result['samples']} samples at temperature {result['temperature']}",
        "| metric | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for key in keys:
        cells = [f"{metrics[key]:.3f}"]
        if baseline is not None:
            before = baseline.get(key)
            cells = [
                "n/a" if before is None else f"{before:.3f}",
                *cells,
                "n/a" if before is None else f"{metrics[key] - before:+.3f}",
            ]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.eval", "engine-eval"),
        description="Evaluate a checkpoint on a task's held-out problems.",
    )
    parser.add_argument("checkpoint", help="run dir, checkpoint dir or tinker:// path")
    parser.add_argument("--step", type=int, help="a run dir's checkpoint of this step")
    parser.add_argument("--task", help="the task (default: the run's)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--samples",
        type=int,
        help=f"sampled responses per problem (default: the largest --k, else {DEFAULT_SAMPLES})",
    )
    parser.add_argument("--k", metavar="K[,K...]", help="also pass@k for each k, e.g. 1,4,8")
    parser.add_argument(
        "--response-texts",
        type=int,
        default=4,
        metavar="N",
        help="sampled responses per problem whose text the JSON keeps (4; all keep rewards)",
    )
    parser.add_argument("--temperature", type=float, help="for the samples (default: the run's)")
    parser.add_argument("--max-tokens", type=positive_int, help="per response (default: the run's)")
    parser.add_argument("--baseline", action="store_true", help="also evaluate step 0")
    parser.add_argument("--out", type=Path, help="the JSON result's file")
    parser.add_argument("--data-dir", type=Path, help="a local server's data dir")
    parser.add_argument("--base-url", help="the server a tinker:// checkpoint lives on")
    add_version_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 0:
        parser.error(f"--samples must be >= 0, got {args.samples}")
    if args.response_texts < 0:
        parser.error(f"--response-texts must be >= 0, got {args.response_texts}")
    if args.temperature is not None and not args.temperature > 0:
        parser.error(
            f"--temperature must be > 0 (the greedy responses are evaluated anyway), "
            f"got {args.temperature}"
        )
    try:
        _check_out(args.out, args.checkpoint)
        request = EvalRequest(
            checkpoint=args.checkpoint,
            step=args.step,
            task=args.task,
            task_args=parse_task_args(args.task_arg),
            samples=args.samples,
            ks=() if args.k is None else _ks(args.k),
            texts=args.response_texts,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            baseline=args.baseline,
            data_dir=args.data_dir,
            base_url=args.base_url,
        )
        result = anyio.run(run_eval, request)
    except (EngineError, BaseExceptionGroup) as exc:
        error = find_error(exc, EngineError)
        if error is None:
            raise
        print(f"Error: {error}", file=sys.stderr)
        return 2
    print(format_table(result))
    out = args.out
    if out is None and result["step"] is not None:  # a run dir's checkpoint
        out = Path(args.checkpoint) / f"eval-step{result['step']}.json"
    if out is not None:
        text = json.dumps(result, indent=2, sort_keys=True, default=str) + "\n"
        try:
            write_file_atomically(out, text.encode())
        except RunFileError as exc:  # checked up front, so the disk filled or it changed
            print(f"Error: {exc}", file=sys.stderr)
            return 1
        print(out)
    return 0


def _check_out(out: Path | None, checkpoint: str) -> None:
    """ConfigError unless the JSON result can be written where it goes (``--out``, else a
    run dir's ``eval-step<N>.json``), so nothing is evaluated in vain."""
    if out is None:
        run_dir = Path(checkpoint).expanduser()
        if not (run_dir / CHECKPOINTS_FILE).is_file():
            return  # not a run dir: the result is only printed
        reason = unwritable_reason(run_dir)
        if reason is not None:
            raise ConfigError(
                f"cannot write the result in the run directory {run_dir} ({reason}): "
                "give --out FILE"
            )
        return
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give the result file's path")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist")
    reason = unwritable_reason(out.parent)
    if reason is not None:
        raise ConfigError(f"cannot write --out {out} ({reason}): give another --out")


def _ks(text: str) -> tuple[int, ...]:
    """``--k``'s list, parsed and checked as ``--eval-k``'s."""
    field = setting_at("evaluation.eval_k")
    assert field is not None
    ks: tuple[int, ...] = parse_text(field, text, "--k")
    if not ks:
        raise ConfigError(f"--k must name at least one k, e.g. 1,4,8, got {text!r}")
    return ks


if __name__ == "__main__":
    raise SystemExit(main())
