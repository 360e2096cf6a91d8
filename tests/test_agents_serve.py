"""``engine.serve`` answers the ``openai`` client for a trained checkpoint: one step
trained on the local server, its checkpoint served on the OpenAI-compatible endpoint
(sampled where it lives, through the session seam), chat and text completions over
loopback; the judge task (``judge.api=openai``) scores through it with no hosted key; a
wrong key is a 401, and a bad checkpoint a one-line error."""

from __future__ import annotations

from pathlib import Path

import anyio
import openai
import pytest

from engine.catalog import load_task
from engine.local import LocalServer
from engine.serve import ServeRequest, main, serve
from engine.tasks.judge import JudgedTask, OpenAIJudgeModel
from tests.engine_support import API_KEY, run_engine, small_config


def test_a_trained_checkpoint_answers_the_openai_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with LocalServer(api_key=API_KEY) as server:
        _, result = run_engine(small_config(server, tmp_path / "run", steps=1))
        monkeypatch.setenv("MINT_API_KEY", API_KEY)
        monkeypatch.delenv("MINT_BASE_URL", raising=False)
        request = ServeRequest(str(result.run_dir), api_key="sk-serve", max_tokens=8)

        async def go() -> None:
            ready = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: serve(request, ready=ready))
                with anyio.fail_after(120):
                    await ready.wait()
                base_url = capsys.readouterr().out.strip().splitlines()[0]
                async with openai.AsyncOpenAI(
                    base_url=base_url, api_key="sk-serve", max_retries=0
                ) as client:
                    chat = await client.chat.completions.create(
                        model="x",
                        messages=[{"role": "user", "content": "1 + 2 = ?"}],
                        n=2,
                        logprobs=True,
                        temperature=1.0,
                        seed=3,
                    )
                    assert len(chat.choices) == 2
                    assert chat.usage is not None and chat.usage.prompt_tokens > 0
                    for choice in chat.choices:
                        assert choice.finish_reason in ("stop", "length")
                        assert choice.logprobs is not None and choice.logprobs.content
                    text = await client.completions.create(
                        model="x", prompt="1 + 2 =", max_tokens=4
                    )
                    assert text.usage is not None and text.usage.completion_tokens <= 4
                    models = await client.models.list()
                    assert models.data[0].id.startswith("tinker://")
                await judges_through(base_url, monkeypatch)
                async with openai.AsyncOpenAI(
                    base_url=base_url, api_key="sk-wrong", max_retries=0
                ) as wrong:
                    with pytest.raises(openai.AuthenticationError):
                        await wrong.completions.create(model="x", prompt="1", max_tokens=1)
                tg.cancel_scope.cancel()

        anyio.run(go)


async def judges_through(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``judge:arithmetic`` task whose judge is the served checkpoint: its key is the
    endpoint's own (``ENGINE_JUDGE_API_KEY``), no hosted key is set."""
    for hosted in ("OPENAI_API_KEY", "MINT_API_KEY"):
        monkeypatch.delenv(hosted, raising=False)
    monkeypatch.setenv("ENGINE_JUDGE_API_KEY", "sk-serve")
    args = {"judge.url": base_url, "judge.model": "policy", "judge.max_tokens": "4"}
    task = load_task("judge:arithmetic", args)
    assert isinstance(task, JudgedTask) and isinstance(task.judge.model, OpenAIJudgeModel)
    problem = task.source(0).next()
    assert problem is not None
    breakdown = await task.score(" 5", problem)
    assert 0.0 <= breakdown.total <= 1.0
    metrics = task.metrics()
    assert metrics["judge/calls"] == 1.0 and metrics["judge/retries"] == 0.0
    assert metrics["judge/prompt_tokens"] > 0 and metrics["judge/completion_tokens"] >= 1


def test_a_checkpoint_that_does_not_exist_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--port", "99999"], "--port: must be a port number in 0..65535, got '99999'"),
        (["--port", "-1"], "--port: must be a port number in 0..65535, got '-1'"),
        (["--port", "http"], "--port: must be a port number in 0..65535, got 'http'"),
        (["--max-tokens", "0"], "--max-tokens: must be an integer >= 1, got '0'"),
    ],
)
def test_bad_flags_are_one_line_errors(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser, not a traceback from bind() (or the config's field name)
    once the checkpoint is loaded."""
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"Error: argument {error} (see --help)\n"


def test_a_non_loopback_host_without_a_key_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As engine.local refuses it: the model is never served to every interface keyless."""
    monkeypatch.delenv("ENGINE_SERVE_API_KEY", raising=False)
    assert main([str(tmp_path / "missing"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to bind non-loopback host '0.0.0.0'" in err


def test_a_prompt_over_the_context_is_refused_before_it_is_tokenized() -> None:
    """An 8 MiB prompt was rendered and tokenized on the event loop (12-17 s) before the
    context check; its characters alone now show it cannot fit."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from engine.agents.openai_wire import ChatRequest, CompletionRequest, EndpointError
    from engine.basemodels.catalogue import DEFAULT_MODEL_DIR
    from engine.serve import SessionBackend

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    encoded: list[int] = []
    encode = tokenizer.encode

    def counted(text: str, **kwargs: object) -> list[int]:
        encoded.append(len(text))
        return encode(text, **kwargs)  # type: ignore[no-any-return]

    tokenizer.encode = counted
    session = SimpleNamespace(tokenizer=tokenizer, info=SimpleNamespace(max_context=256))
    backend = SessionBackend(session, None, model="m", max_tokens=8)  # type: ignore[arg-type]
    huge = "1 + 2 = ? " * 200_000

    async def go() -> None:
        with pytest.raises(EndpointError, match="over the model's context of 256 tokens"):
            await backend.complete(CompletionRequest(model="m", prompt=huge))
        chat = ChatRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": huge}]}
        )
        with pytest.raises(EndpointError, match="over the model's context of 256 tokens"):
            await backend.chat(chat)

    anyio.run(go)
    assert all(n < len(huge) for n in encoded)  # only ChatFormat's probe was tokenized
