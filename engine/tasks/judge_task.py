"""``--task judge:SPEC``: the task ``SPEC`` names, its reward replaced by a judge.

The judge is set by ``judge.*`` task arguments (``--task-arg judge.url=...``); the other
arguments go to ``SPEC``'s task, which takes the settings the server recommends for
``SPEC`` (``judge:arithmetic`` asks what ``arithmetic`` asks). The API key is read from
the environment variable ``judge.api_key_env`` names (default ``ENGINE_JUDGE_API_KEY``,
else ``OPENAI_API_KEY`` / ``MINT_API_KEY``), so no secret reaches the command line or
the run directory (``config.json`` records the task arguments); a ``mint`` judge on a
loopback URL needs none (a local server without a key takes any), so judging never
needs ``MINT_API_KEY``, which would send the training to that server::

    --task judge:jsonl:data.jsonl --task-arg chat=true \\
        --task-arg judge.url=http://host:8000/v1 --task-arg judge.model=grader

``judge.api=openai`` (default) posts to an OpenAI-compatible ``/chat/completions`` (a
hosted API, or ``python -m engine.serve CHECKPOINT``); ``judge.api=mint`` samples a MinT
server's (or a local server's) ``judge.model`` base model through the ``mint`` SDK,
connected on the first call; ``judge.api=local`` samples through the run's own session
(:class:`SessionJudgeModel`: the engine's local server with ``--local``): its base model,
or a checkpoint's sampler weights (``judge.model=tinker://...``), with no second server,
no URL and no key. See
docs/export-and-eval.md for every argument.
"""

from __future__ import annotations

import os
import string
import urllib.parse
from collections.abc import Callable, Mapping

import anyio

from engine.common.protocol import LOCAL_PLACEHOLDER_KEY
from engine.core.problems import Task
from engine.errors import ConfigError, EngineError
from engine.session.api import SamplerHandle, SamplingParams, Session
from engine.tasks.arithmetic import extract_prediction
from engine.tasks.dataset import flag_arg
from engine.tasks.judge import (
    DEFAULT_LOG_SAMPLES,
    DEFAULT_RUBRIC,
    Judge,
    JudgedTask,
    JudgeModel,
    JudgeReply,
    MintJudgeModel,
    OpenAIJudgeModel,
    Verdict,
    score_line,
)
from engine.tasks.render import TaskContext, render_prompt

__all__ = [
    "ANSWER_THE_QUESTION",
    "PREFIX",
    "LazyMintJudgeModel",
    "SessionJudgeModel",
    "judged_task",
    "same_number",
]

PREFIX = "judge."
"""Task arguments with this prefix configure the judge."""
DEFAULT_KEY_ENV = {"openai": "OPENAI_API_KEY", "mint": "MINT_API_KEY"}
JUDGE_KEY_ENV = "ENGINE_JUDGE_API_KEY"
"""Read before ``DEFAULT_KEY_ENV``: a judge's key that the engine's own settings never
read (``MINT_API_KEY`` also makes the engine train on that server)."""
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
ANSWER_THE_QUESTION = "{prompt}"
"""The rubric of the ``same-number`` verdict: the judge answers the question itself."""
_FIELDS = {"prompt", "response", "answer"}
_ARGS = (
    "url",
    "model",
    "api",
    "api_key_env",
    "chat",
    "rubric",
    "verdict",
    "scale",
    "concurrency",
    "max_tokens",
    "cache_size",
    "log_samples",
)


def same_number(reply: str, response: str) -> float | None:
    """A reference-free verdict: 1 when the response's first number is the judge's
    reply's, else 0; None when the reply holds no number."""
    expected = extract_prediction(reply)
    if expected is None:
        return None
    return 1.0 if extract_prediction(response) == expected else 0.0


class LazyMintJudgeModel:
    """A MinT sampling client of ``base_model`` at ``base_url``, connected (and its
    tokenizer loaded) on the first call, inside the run's event loop."""

    def __init__(
        self, base_url: str, base_model: str, api_key: str | None, *, chat: bool = True
    ) -> None:
        self._base_url = base_url
        self._base_model = base_model
        self._api_key = api_key
        self._chat = chat
        self._lock = anyio.Lock()
        self._model: MintJudgeModel | None = None

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply:
        async with self._lock:
            if self._model is None:
                self._model = await self._connect()
        return await self._model.complete(prompt, max_tokens=max_tokens)

    async def _connect(self) -> MintJudgeModel:
        from engine.session.mint import service_client

        service = await anyio.to_thread.run_sync(
            service_client, self._base_url, self._api_key, abandon_on_cancel=True
        )
        sampler = await service.create_sampling_client_async(base_model=self._base_model)
        tokenizer = await anyio.to_thread.run_sync(sampler.get_tokenizer, abandon_on_cancel=True)
        return MintJudgeModel(sampler, tokenizer, chat=self._chat)


class SessionJudgeModel:
    """The judge as the run's own session samples it (``judge.api=local``): its base
    model (``model`` None) or the sampler weights at ``model`` (a ``tinker://`` path),
    opened on the first call; the rubric rendered as :class:`MintJudgeModel` renders it,
    the reply greedy. The session comes with the task's setup (:meth:`bind`)."""

    def __init__(self, model: str | None, *, chat: bool = True) -> None:
        self._model = model
        self._chat = chat
        self._session: Session | None = None
        self._sampler: SamplerHandle | None = None
        self._lock = anyio.Lock()

    def bind(self, context: TaskContext) -> None:
        """The run's session, from the task's setup."""
        self._session = context.session

    async def complete(self, prompt: str, *, max_tokens: int) -> JudgeReply:
        session = self._session
        if session is None:
            raise EngineError(
                f"{PREFIX}api=local judges through the run's session, and this task was "
                "not set up by a run"
            )
        async with self._lock:
            if self._sampler is None:
                self._sampler = await (
                    session.open_base_sampler()
                    if self._model is None
                    else session.open_sampler(0, self._model)
                )
        tokenizer = session.tokenizer
        chat = self._chat and getattr(tokenizer, "chat_template", None) is not None
        tokens = render_prompt(tokenizer, [{"role": "user", "content": prompt}] if chat else prompt)
        eos = getattr(tokenizer, "eos_token_id", None)
        settings = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            stop_token_ids=(eos,) if isinstance(eos, int) else (),
        )
        result = await session.sample(self._sampler, tokens, 1, settings)
        out = list(result.completions[0].tokens)
        text = str(tokenizer.decode(out, skip_special_tokens=True))
        return JudgeReply(text, len(tokens), len(out))


def judged_task(
    spec: str, args: Mapping[str, str], load: Callable[[str, Mapping[str, str]], Task]
) -> JudgedTask:
    """``judge:SPEC`` with its task arguments: ``load`` builds ``SPEC``'s task from the
    arguments without the ``judge.`` prefix. Raises ConfigError with a one-line reason."""
    inner = spec.removeprefix("judge:")
    if not inner:
        raise ConfigError("invalid task 'judge:': name the judged task, e.g. judge:arithmetic")
    own = {k.removeprefix(PREFIX): v for k, v in args.items() if k.startswith(PREFIX)}
    rest = {k: v for k, v in args.items() if not k.startswith(PREFIX)}
    task = load(inner, rest)
    try:
        return JudgedTask(task, _judge(own))
    except ValueError as exc:
        raise ConfigError(f"invalid judge ({spec}): {exc}") from exc


def _judge(args: Mapping[str, str]) -> Judge:
    unknown = sorted(set(args) - set(_ARGS))
    if unknown:
        raise ValueError(
            f"unknown argument {PREFIX}{unknown[0]} (known: "
            + ", ".join(PREFIX + a for a in _ARGS)
            + ")"
        )
    api = args.get("api", "openai")
    if api not in (*DEFAULT_KEY_ENV, "local"):
        raise ValueError(f"{PREFIX}api must be openai, mint or local, got {api!r}")
    url, model = args.get("url", ""), args.get("model", "")
    if api == "local":
        if url:
            raise ValueError(
                f"{PREFIX}api=local judges with the run's own server: drop {PREFIX}url"
            )
        if model and not model.startswith("tinker://"):
            raise ValueError(
                f"{PREFIX}model with {PREFIX}api=local is a checkpoint's sampler path "
                f"(tinker://...), or none for the base model; got {model!r}"
            )
    elif not url.startswith(("http://", "https://")):
        raise ValueError(f"{PREFIX}url must be the judge's http(s) base URL, got {url!r}")
    if not model and api != "local":
        raise ValueError(f"{PREFIX}model is required: the judge's model name")
    verdict_name = args.get("verdict", "score")
    verdict: Verdict
    if verdict_name == "score":
        verdict, rubric = score_line(_number(args, "scale", 10.0)), DEFAULT_RUBRIC
    elif verdict_name == "same-number":
        verdict, rubric = same_number, ANSWER_THE_QUESTION
    else:
        raise ValueError(f"{PREFIX}verdict must be score or same-number, got {verdict_name!r}")
    rubric = args.get("rubric", rubric)
    _check_rubric(rubric)
    # Asked the task's own prompt, the judge reads it as the task's model does.
    chat = (
        flag_arg({PREFIX + "chat": args["chat"]}, PREFIX + "chat")
        if "chat" in args
        else rubric != ANSWER_THE_QUESTION
    )
    own = args.get("api_key_env")
    names = [own] if own else [JUDGE_KEY_ENV, DEFAULT_KEY_ENV.get(api, "")]
    api_key = next((os.environ[n] for n in names if os.environ.get(n)), None)
    if api == "mint" and api_key is None:  # the SDK refuses to connect without one
        if urllib.parse.urlsplit(url).hostname not in _LOOPBACK:
            raise ValueError(
                f"{PREFIX}api=mint needs an API key in ${' or $'.join(names)} "
                f"({PREFIX}api_key_env names another variable)"
            )
        api_key = LOCAL_PLACEHOLDER_KEY  # a local server started without a key
    concurrency = _count(args, "concurrency", 8, minimum=1)
    max_tokens = _count(args, "max_tokens", 64, minimum=1)
    cache_size = _count(args, "cache_size", 4096, minimum=0)
    log_samples = _count(args, "log_samples", DEFAULT_LOG_SAMPLES, minimum=0)
    judge_model: JudgeModel  # last: every argument is valid
    if api == "local":
        judge_model = SessionJudgeModel(model or None, chat=chat)
    elif api == "openai":
        judge_model = OpenAIJudgeModel(url, model, api_key=api_key)
    else:
        judge_model = LazyMintJudgeModel(url, model, api_key, chat=chat)
    return Judge(
        judge_model,
        rubric,
        verdict=verdict,
        concurrency=concurrency,
        max_tokens=max_tokens,
        cache_size=cache_size,
        log_samples=log_samples,
    )


def _check_rubric(rubric: str) -> None:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as exc:
        raise ValueError(f"{PREFIX}rubric is not a format string ({exc})") from exc
    if not fields <= _FIELDS or not fields & {"prompt", "response"}:
        raise ValueError(
            f"{PREFIX}rubric may use {{prompt}}, {{response}} and {{answer}} (at least one "
            f"of the first two), got fields {sorted(fields) or 'none'}"
        )


def _count(args: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    text = args.get(name)
    try:
        value = default if text is None else int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{PREFIX}{name} must be an integer >= {minimum}, got {text!r}")
    return value


def _number(args: Mapping[str, str], name: str, default: float) -> float:
    text = args.get(name)
    try:
        value = default if text is None else float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{PREFIX}{name} must be a positive number, got {text!r}")
    return value
