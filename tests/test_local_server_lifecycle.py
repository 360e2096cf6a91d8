"""Starting, stopping and restarting the local server: checkpoints survive a restart (and
a kill -9 of a spawned server) on the same data dir, the CLI validates its options in one
line, and an existing quickstart-style user script runs unchanged with only
MINT_BASE_URL and MINT_API_KEY set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mint
import pytest
from mint import types

from engine.local import LocalServer, spawn_local_server
from engine.local.__main__ import main as cli_main

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

QUESTION = "Question: What is 33 + 44?\nAnswer:"


def training_data(tokenizer) -> list[types.Datum]:
    full = tokenizer.encode(QUESTION + " 77")
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
    ]


def test_checkpoints_survive_a_server_restart_on_the_same_data_dir(tmp_path: Path) -> None:
    with LocalServer(data_dir=tmp_path) as first:
        service = mint.ServiceClient(base_url=first.base_url, api_key="tml-restart")
        tc = service.create_lora_training_client(base_model=first.model_name, rank=8, seed=5)
        tokenizer = tc.get_tokenizer()
        data = training_data(tokenizer)
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("two-steps").result().path
        sampler_path = tc.save_weights_for_sampler("two-steps").result().path
        prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION + " 77"))
        sampler_logprobs = service.create_sampling_client(model_path=sampler_path)
        expected_lp = sampler_logprobs.compute_logprobs(prompt).result()
        expected_fwd = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        first_model = tc.model_id
    assert (tmp_path / first_model / "weights" / "two-steps" / "meta.json").is_file()

    with LocalServer(data_dir=tmp_path) as second:
        service = mint.ServiceClient(base_url=second.base_url, api_key="tml-restart")
        resumed = service.create_training_client_from_state_with_optimizer(state)
        assert resumed.model_id != first_model  # ids are unique across restarts
        assert second.backend_call(lambda b: b.optimizer_steps(resumed.model_id)) == 2
        fwd = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        assert fwd.data == expected_fwd.data
        sampler = service.create_sampling_client(model_path=sampler_path)
        assert sampler.compute_logprobs(prompt).result() == expected_lp
        fresh = service.create_lora_training_client(base_model=second.model_name, rank=8)
        fresh.load_state(state).result()
        assert fresh.forward(data, "cross_entropy").result().loss_fn_outputs[0][
            "logprobs"
        ].data == (expected_fwd.data)


def test_a_spawned_server_can_be_killed_and_restarted(tmp_path: Path) -> None:
    key = "sk-spawned"
    server = spawn_local_server(data_dir=tmp_path, api_key=key, stderr=subprocess.DEVNULL)
    try:
        service = mint.ServiceClient(base_url=server.base_url, api_key=key)
        tc = service.create_lora_training_client(base_model="engine-local/tiny-arith", rank=4)
        data = training_data(tc.get_tokenizer())
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        state = tc.save_state("before-kill").result().path
        assert server.stats()["optimizer_steps"] == {tc.model_id: 1}
    finally:
        server.kill()
    assert server.process.returncode == -9

    with spawn_local_server(data_dir=tmp_path, api_key=key, stderr=subprocess.DEVNULL) as again:
        assert again.base_url != "" and again.process.poll() is None
        service = mint.ServiceClient(base_url=again.base_url, api_key=key)
        resumed = service.create_training_client_from_state_with_optimizer(state)
        resumed.forward_backward(data, "cross_entropy")
        resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert again.stats()["optimizer_steps"] == {resumed.model_id: 1}
    assert again.process.returncode == 0  # SIGTERM stops it cleanly


def _standalone(tmp_path: Path, *args: str) -> tuple[str, str]:
    """Start ``python -m engine.local`` with a private XDG_DATA_HOME and HOME, stop it
    with SIGTERM once ready; return (its stderr, its exit code)."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    env.pop("ENGINE_LOCAL_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.local", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        assert process.stdout.readline().startswith("engine.local: serving ")
        process.terminate()
        _, after = process.communicate(timeout=120)
    finally:
        process.kill()
    return after, str(process.returncode)


def test_a_standalone_server_keeps_its_data_in_a_named_place_by_default(tmp_path: Path) -> None:
    stderr, code = _standalone(tmp_path)
    data_dir = tmp_path / "xdg" / "engine" / "local-server"
    assert code == "0"
    assert f"engine.local: data dir {data_dir} (kept when the server stops" in stderr
    assert data_dir.is_dir()
    assert not (tmp_path / "home").exists()


def test_an_ephemeral_standalone_server_says_its_data_dir_is_deleted(tmp_path: Path) -> None:
    stderr, code = _standalone(tmp_path, "--ephemeral")
    assert code == "0"
    start, stop = (line for line in stderr.splitlines() if "--ephemeral" in line)
    temporary = start.split("data dir ", 1)[1].split(" ", 1)[0]
    assert "temporary" in start and "deleted when the server stops" in start
    assert f"deleted the temporary data dir {temporary}" in stop
    assert not Path(temporary).exists()
    assert not (tmp_path / "xdg").exists()


def test_cli_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--model",
        "--api-key",
        "--data-dir",
        "--faults",
        "--latency",
        "--log-level",
        "--model-alias",
        "--max-body-bytes",
        "--max-datums",
        "--max-request-tokens",
        "--max-seq-gap",
        "--seq-gap-timeout",
        "--header-timeout",
        "--body-timeout",
    ):
        assert option in out
    assert "fault spec" in out and "latency profile" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--port", "x"], "argument --port: must be an integer in 0..65535, got 'x'"),
        (["--port", "70000"], "argument --port: must be an integer in 0..65535"),
        (["--host", "0.0.0.0"], "refusing to bind non-loopback host '0.0.0.0' without an API key"),
        (["--faults", "500:7"], "rate must be in [0, 1]"),
        (["--latency", "mint:warp=9"], "must be KEY=SECONDS"),
        (["--model", "/no/such/dir"], "model directory '/no/such/dir' does not exist"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--data-dir", "/proc/nope"], "--data-dir /proc/nope: cannot create it"),
        (["--max-datums", "0"], "argument --max-datums: must be a positive integer, got '0'"),
        (["--max-request-tokens", "1e9"], "argument --max-request-tokens: must be a positive"),
        (["--max-seq-gap", "-1"], "argument --max-seq-gap: must be a positive integer"),
        (["--header-timeout", "0"], "argument --header-timeout: must be a number of seconds > 0"),
        (["--body-timeout", "nan"], "argument --body-timeout: must be a number of seconds > 0"),
        (["--max-upload-bytes", "0"], "argument --max-upload-bytes: must be a positive integer"),
        (["--ephemeral", "--data-dir", "d"], "argument --data-dir: not allowed with argument"),
    ],
)
def test_cli_rejects_bad_options_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m engine.local: error: ")
    assert message in err


USER_SCRIPT = textwrap.dedent(
    '''
    """A quickstart-style custom-reward loop, as a MinT user would write it."""
    import os
    import random
    import re

    import mint
    from mint import types

    BASE_MODEL = os.environ.get("MINT_BASE_MODEL", "Qwen/Qwen3-0.6B")


    def reward(text, answer):
        match = re.search(r"-?\\d+", text)
        if match is None:
            return 0.0
        error = abs(int(match.group()) - answer)
        closeness = max(0.0, 1.0 - min(error / max(abs(answer), 20), 1.0))
        return min(1.0, 0.2 + 0.5 * closeness + (0.3 if error == 0 else 0.0))


    def main():
        random.seed(42)
        service = mint.ServiceClient()
        service.get_server_capabilities()
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=8)
        tokenizer = training.get_tokenizer()
        for step in range(2):
            sampler = training.save_weights_and_get_sampling_client()
            datums, rewards_seen = [], []
            for _ in range(2):
                a, b = random.randint(10, 99), random.randint(10, 99)
                prompt = tokenizer.encode(f"Question: What is {a} + {b}?\\nAnswer:")
                result = sampler.sample(
                    types.ModelInput.from_ints(prompt),
                    num_samples=4,
                    sampling_params=types.SamplingParams(max_tokens=8, temperature=0.8),
                ).result()
                rewards = [reward(tokenizer.decode(s.tokens), a + b) for s in result.sequences]
                rewards_seen += rewards
                mean = sum(rewards) / len(rewards)
                for seq, r in zip(result.sequences, rewards):
                    advantage = r - mean
                    if not seq.tokens or abs(advantage) < 1e-12:
                        continue
                    full = prompt + seq.tokens
                    pad = [0.0] * (len(prompt) - 1)
                    datums.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={
                                "target_tokens": full[1:],
                                "logprobs": pad + list(seq.logprobs),
                                "advantages": pad + [advantage] * len(seq.tokens),
                            },
                        )
                    )
            if datums:
                training.forward_backward(datums, loss_fn="importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=2e-5)).result()
            avg = sum(rewards_seen) / len(rewards_seen)
            print(f"Step {step + 1}: avg_reward={avg:.3f}, datums={len(datums)}")
        path = training.save_weights_for_sampler("custom-reward-final").result().path
        print(f"Saved: {path}")


    if __name__ == "__main__":
        main()
    '''
)


def test_an_existing_user_script_runs_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "custom_reward.py"
    script.write_text(USER_SCRIPT)
    key = "sk-user-script"
    # The script hard-codes the hosted default model; the alias maps it to the local one.
    with LocalServer(api_key=key, model_aliases=["Qwen/Qwen3-0.6B"]) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
        env.update(MINT_BASE_URL=server.base_url, MINT_API_KEY=key)
        done = subprocess.run(
            [sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        lines = done.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[:2]] == ["Step 1", "Step 2"]
        assert lines[-1].startswith("Saved: tinker://model-")
        assert lines[-1].endswith("/sampler_weights/custom-reward-final")
        stats = server.stats
        assert list(stats.optimizer_steps.values()) == [2]
        assert stats.applied["asample"] == 4
