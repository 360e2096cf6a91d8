"""From a task's prompt to token ids, and from sampled tokens back to the text it scores.

Why one renderer: a prompt is either a raw string (encoded as the MinT quickstart does,
``tokenizer.encode(text)``) or a list of chat messages rendered by the *served* model's
chat template (``apply_chat_template(..., add_generation_prompt=True)``), and the same
object must decide the sampler's stop strings and how a response is decoded. Tasks never
reach for a global tokenizer: one that needs it gets a :class:`TaskContext` through an
optional ``setup(context)`` method.

Optional task members read here (a task without them behaves as before):

* ``stop``: stop strings sent to the sampler (``--stop-at-eos`` adds the EOS token's
  text).
* ``skip_special_tokens``: decode responses without special tokens (default False:
  ``tokenizer.decode(tokens)``, as the quickstart does).
* ``chat_template_options``: keyword arguments for the chat template, e.g.
  ``{"enable_thinking": False}`` for Qwen3.
* ``setup(context)``: called once with the :class:`TaskContext` before the first prompt.

The text a reward, a judge or an environment sees ends before the first stop string,
stop token or end-of-sequence token (``' 76'``, not the quickstart's ``' 76</s>'``), so
that ``response == answer`` works; the trained tokens are the sampled ones, unchanged.
``--keep-stop-text`` gives a task's reward the decoded text whole, as the quickstart saw
it (an environment's conversation always holds the cut text: the chat template writes
the end token itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.session.api import Session

__all__ = ["ChatMessage", "Prompt", "PromptRenderer", "TaskContext", "render_prompt"]

ChatMessage = Mapping[str, Any]
"""One chat message: ``{"role": "user", "content": "..."}``."""

Prompt = str | Sequence[ChatMessage]


@dataclass(frozen=True)
class TaskContext:
    """What a task may need from the served model and the run: the tokenizer, the
    chat-template options the task set, how responses are decoded, the run dir."""

    tokenizer: Any
    chat_template_options: Mapping[str, Any] = field(default_factory=dict)
    skip_special_tokens: bool = False
    run_dir: Path | None = None
    """The run's directory, for a task's own files (a judge's ``judge.jsonl``); None
    outside a run."""
    session: Session | None = None
    """The run's session (a ``judge.api=local`` judge samples through it); None outside
    a run, and in a worker process (it belongs to the engine's event loop)."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "session": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def render(self, prompt: Prompt) -> list[int]:
        """The prompt token ids of ``prompt`` (see :func:`render_prompt`)."""
        return render_prompt(self.tokenizer, prompt, self.chat_template_options)

    def decode(self, tokens: Sequence[int]) -> str:
        """``tokens`` decoded whole (special tokens skipped if the task says so)."""
        return str(
            self.tokenizer.decode(list(tokens), skip_special_tokens=self.skip_special_tokens)
        )

    def response_text(
        self,
        tokens: Sequence[int],
        stop_strings: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> str:
        """The sampled ``tokens`` as the text a reward or an environment reads: cut
        before the first stop token or EOS token, then before the first stop string or
        the EOS token's text. The one rule of response decoding (see the module doc)."""
        ids = list(tokens)
        eos_id = getattr(self.tokenizer, "eos_token_id", None)
        ends = {*stop_token_ids, *([eos_id] if isinstance(eos_id, int) else [])}
        text = self.decode(ids[: next((i for i, t in enumerate(ids) if t in ends), len(ids))])
        eos_text = getattr(self.tokenizer, "eos_token", None)
        ends_text = [*stop_strings, *([eos_text] if isinstance(eos_text, str) else [])]
        cuts = [cut for cut in (text.find(s) for s in ends_text if s) if cut >= 0]
        return text[: min(cuts)] if cuts else text


def render_prompt(
    tokenizer: Any, prompt: Prompt, chat_template_options: Mapping[str, Any] | None = None
) -> list[int]:
    """A string is encoded as is (``tokenizer.encode``, special tokens added as the
    tokenizer does by default); chat messages are rendered by the tokenizer's chat
    template with the generation prompt, then encoded without adding special tokens
    (the template writes them)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    messages = [dict(m) for m in prompt]
    if not messages or not all(isinstance(m.get("role"), str) for m in messages):
        raise ValueError("a chat prompt must be a non-empty list of {'role', 'content'} dicts")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "the task's prompt is a list of chat messages but the served tokenizer has no "
            "chat template; return a string prompt instead"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_options or {})
    )
    return list(tokenizer.encode(str(text), add_special_tokens=False))


class PromptRenderer:
    """A task's prompts, stop strings and response decoding for one tokenizer
    (``keep_stop_text``: ``--keep-stop-text``; ``run_dir``: the run's directory;
    ``session``: the run's session)."""

    def __init__(
        self,
        task: Any,
        tokenizer: Any,
        *,
        keep_stop_text: bool = False,
        run_dir: Path | None = None,
        session: Session | None = None,
    ) -> None:
        self._task = task
        self.context = TaskContext(
            tokenizer,
            dict(getattr(task, "chat_template_options", {})),
            skip_special_tokens=bool(getattr(task, "skip_special_tokens", False)),
            run_dir=run_dir,
            session=session,
        )
        self._keep_stop_text = keep_stop_text
        self._stop = tuple(str(s) for s in getattr(task, "stop", ()) or ())
        if not all(self._stop):
            raise ConfigError(f"task {getattr(task, 'name', task)!r} declares an empty stop string")
        setup = getattr(task, "setup", None)
        if callable(setup):
            setup(self.context)

    @property
    def tokenizer(self) -> Any:
        return self.context.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        return self.context.render(prompt)

    def prompt_tokens(self, problem: Any) -> list[int]:
        """The token ids of ``task.prompt(problem)``."""
        return self.encode(self._task.prompt(problem))

    def decode(self, tokens: Sequence[int]) -> str:
        """A response as the task scores it: :meth:`TaskContext.response_text` with the
        task's stop strings, or (``keep_stop_text``) decoded whole."""
        if self._keep_stop_text:
            return self.context.decode(tokens)
        return self.context.response_text(tokens, self._stop)

    def decode_prompt(self, tokens: Sequence[int]) -> str:
        """A prompt as text, special tokens kept (for reading rollouts)."""
        return str(self.tokenizer.decode(list(tokens)))

    def stops(self, *, stop_at_eos: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(stop strings, stop token ids) for the sampler: the task's stop strings, plus
        the EOS token's text with ``stop_at_eos``; without stop strings, the EOS id with
        ``stop_at_eos`` (the SDK takes one kind per request)."""
        if self._stop:
            eos_text = getattr(self.tokenizer, "eos_token", None)
            if stop_at_eos and isinstance(eos_text, str) and eos_text not in self._stop:
                return (*self._stop, eos_text), ()
            return self._stop, ()
        eos_id = getattr(self.tokenizer, "eos_token_id", None)
        return (), ((eos_id,) if stop_at_eos and isinstance(eos_id, int) else ())
