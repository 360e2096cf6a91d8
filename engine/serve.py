"""``python -m engine.serve CHECKPOINT``: serve a trained checkpoint on the OpenAI-compatible
endpoint (:mod:`engine.agents.endpoint`) without training, for the judge task
(``judge.api=openai``), eval harnesses and scripts.

CHECKPOINT is a run dir, a checkpoint dir or a ``tinker://`` path, resolved as
``engine.eval`` does: a checkpoint whose files are here is served by a local server
started on a temporary data dir; any other is sampled where it lives (``--base-url`` /
``MINT_BASE_URL`` with ``MINT_API_KEY``). Calls sample through the session directly:
``temperature`` (default 1), ``seed``, ``max_tokens`` (default ``--max-tokens``), ``stop``,
``n`` and ``logprobs`` are honoured; replies end at the model's EOS. ``--api-key`` (or
``ENGINE_SERVE_API_KEY``) is the key callers must send (none: any). Runs until SIGINT or
SIGTERM; the first line printed is the base URL.
"""

from __future__ import annotations

import functools
import hmac
import os
import signal
import sys
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio

from engine.agents.chat import Answer, ChatFormat
from engine.agents.openai_wire import ChatRequest, CompletionRequest, EndpointError
from engine.checkpoint_files import resolve_checkpoint
from engine.common.cli import (
    OneLineErrorParser,
    add_version_flag,
    port_number,
    positive_int,
    program_name,
)
from engine.common.net import is_loopback_host
from engine.errors import ConfigError, EngineError, find_error
from engine.eval import EvalRequest, open_checkpoint_session
from engine.session.api import SamplerHandle, SamplingParams, Session
from engine.tasks import TaskContext
from engine.tasks.conversations import max_context_chars

__all__ = ["ServeRequest", "SessionBackend", "main", "serve"]


@dataclass(frozen=True)
class ServeRequest:
    checkpoint: str
    step: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_tokens: int | None = None
    base_url: str | None = None


class SessionBackend:
    """The endpoint's callers for one sampler of a session (no episodes)."""

    def __init__(
        self,
        session: Session,
        sampler: SamplerHandle,
        *,
        model: str,
        max_tokens: int,
        api_key: str | None = None,
    ) -> None:
        self._session = session
        self._sampler = sampler
        self._chat = ChatFormat(TaskContext(session.tokenizer))
        self._max_tokens = max_tokens
        self._api_key = api_key
        self.model = model
        self._max_chars = max_context_chars(session.tokenizer, session.info.max_context)

    def caller(self, episode: str | None, api_key: str | None) -> SessionBackend:
        if self._api_key is not None and (
            api_key is None or not hmac.compare_digest(api_key.encode(), self._api_key.encode())
        ):
            raise EndpointError(401, "invalid API key")
        if episode is not None:
            raise EndpointError(404, "this endpoint serves a checkpoint: it has no episodes")
        return self

    async def chat(self, request: ChatRequest) -> Answer:
        if isinstance(request.tool_choice, dict) or request.tool_choice == "required":
            raise EndpointError(
                400,
                "tool_choice must be 'auto' or 'none': the sampler cannot force a call",
                param="tool_choice",
            )
        if request.top_logprobs:
            raise EndpointError(400, "top_logprobs is not supported", param="top_logprobs")
        tools = self._chat.tools(request.tools) if request.tool_choice != "none" else []
        messages = self._chat.messages(request.messages)
        text = await anyio.to_thread.run_sync(
            functools.partial(self._chat.render_text, messages, tools, generation=True)
        )
        prompt = await self._encode(text)
        return await self._sample(
            prompt, request, request.token_limit(), bool(request.logprobs), bool(tools)
        )

    async def complete(self, request: CompletionRequest) -> Answer:
        if request.echo:
            raise EndpointError(400, "echo is not supported", param="echo")
        given = request.prompt
        prompt = self._chat.prompt_tokens(
            await self._encode(given) if isinstance(given, str) else given
        )
        return await self._sample(
            prompt, request, request.max_tokens, request.logprobs is not None, False
        )

    async def _encode(self, text: str) -> tuple[int, ...]:
        """``text``'s tokens, tokenized off the event loop; a 400 without tokenizing when
        it has more characters than the context can hold."""
        if self._max_chars is not None and len(text) > self._max_chars:
            raise EndpointError(
                400,
                f"the prompt ({len(text)} characters) is over the model's context of "
                f"{self._session.info.max_context} tokens",
            )
        return await anyio.to_thread.run_sync(self._chat.encode, text)

    async def _sample(
        self,
        prompt: Sequence[int],
        request: ChatRequest | CompletionRequest,
        limit: int | None,
        logprobs: bool,
        tools: bool,
    ) -> Answer:
        if request.top_p is not None and request.top_p < 1.0:
            raise EndpointError(400, "top_p < 1 is not supported by the sampler", param="top_p")
        max_tokens = limit or self._max_tokens
        context = self._session.info.max_context
        if context is not None and len(prompt) + max_tokens > context:
            raise EndpointError(
                400,
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is over "
                f"the model's context of {context} tokens",
            )
        tokenizer = self._chat.tokenizer
        eos_id = getattr(tokenizer, "eos_token_id", None)
        eos = getattr(tokenizer, "eos_token", None)
        stops = request.stop_strings()
        settings = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            seed=request.seed,
            stop_token_ids=(eos_id,) if isinstance(eos_id, int) else (),
            stop_strings=(*stops, *((eos,) if isinstance(eos, str) else ())) if stops else (),
        )
        result = await self._session.sample(self._sampler, prompt, request.n, settings)
        choices = tuple(
            self._chat.choice(
                c.tokens,
                c.stop_reason,
                stops,
                tools=tools,
                logprobs=c.logprobs if logprobs else None,
            )
            for c in result.completions
        )
        return Answer(len(prompt), choices)


async def serve(request: ServeRequest, *, ready: anyio.Event | None = None) -> None:
    """Serve ``request.checkpoint`` until cancelled; ``ready`` is set once it answers."""
    if not is_loopback_host(request.host) and request.api_key is None:
        raise ConfigError(  # the local server's rule (engine.local.config too)
            f"refusing to bind non-loopback host {request.host!r} without an API key "
            "(pass --api-key or set ENGINE_SERVE_API_KEY, or bind 127.0.0.1)"
        )
    from engine.agents.endpoint import serve_endpoint  # the HTTP server stack: not for --help

    ref = resolve_checkpoint(request.checkpoint, step=request.step)
    eval_request = EvalRequest(
        request.checkpoint,
        step=request.step,
        task=None if ref.run_dir is not None else "arithmetic",  # (no task is served)
        max_tokens=request.max_tokens,
        base_url=request.base_url,
    )
    async with AsyncExitStack() as stack:
        opened = await stack.enter_async_context(
            open_checkpoint_session(eval_request, ref, prefix="engine-serve-")
        )
        session = opened.session
        backend = SessionBackend(
            session,
            await opened.open_sampler(),
            model=ref.tinker_path or request.checkpoint,
            max_tokens=session.config.sampling.max_tokens,
            api_key=request.api_key,
        )
        endpoint = await stack.enter_async_context(
            serve_endpoint(backend, host=request.host, port=request.port)
        )
        print(endpoint.base_url, flush=True)
        if ready is not None:
            ready.set()
        await anyio.sleep_forever()


def _parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog=program_name("engine.serve", "engine-serve"),
        description="Serve a checkpoint on an OpenAI-compatible endpoint.",
    )
    parser.add_argument("checkpoint", help="run dir, checkpoint dir or tinker:// path")
    parser.add_argument("--step", type=int, help="a run dir's checkpoint of this step")
    parser.add_argument(
        "--host", default="127.0.0.1", help="default: loopback (another address needs a key)"
    )
    parser.add_argument("--port", type=port_number, default=0, help="default: a free port")
    parser.add_argument("--api-key", help="the key callers must send (ENGINE_SERVE_API_KEY)")
    parser.add_argument("--max-tokens", type=positive_int, help="per reply when a call sets none")
    parser.add_argument("--base-url", help="the server a tinker:// checkpoint lives on")
    add_version_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    request = ServeRequest(
        args.checkpoint,
        step=args.step,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("ENGINE_SERVE_API_KEY") or None,
        max_tokens=args.max_tokens,
        base_url=args.base_url,
    )

    async def run() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve, request)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

    try:
        anyio.run(run)
    except (EngineError, OSError, BaseExceptionGroup) as exc:
        error = find_error(exc, EngineError) or find_error(exc, OSError)
        if error is None:
            raise
        print(f"Error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
