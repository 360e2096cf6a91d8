"""The shipped default model and the script that makes it: offline byte-level tokenizer,
metadata the server reads, a starting greedy exact rate inside 20-60% measured through
the backend, RL-friendly sampling at temperature 0.8, and a reproducible build."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_util import greedy_exact_rate, new_backend, prompt_ids
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from engine.local.compute.backend_types import SampleJob
from scripts import make_model

# A real-server end-to-end set: deselected by default, run with -m slow (CI runs both).
pytestmark = pytest.mark.slow

SHIPPED = make_model.DEFAULT_OUT
AGENT = make_model.AGENT_OUT


def test_shipped_tokenizer_loads_offline_and_is_byte_level() -> None:
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 259
    for text in ["Question: What is 12 + 34?\nAnswer: 46", "héllo ∑ 🙂", "  -7\t"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert all(len(tok.encode(d, add_special_tokens=False)) == 1 for d in "0123456789")


def test_shipped_model_metadata_and_size() -> None:
    meta = json.loads((SHIPPED / make_model.METADATA_FILE).read_text())
    assert meta["model_name"] == "engine-local/tiny-arith"
    assert 0.2 <= meta["greedy_exact_rate"] <= 0.6
    assert meta["recommended_rl"] == make_model.RL_DEFAULTS
    total = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert total < 4_000_000
    assert (SHIPPED / "README.md").is_file()
    backend = new_backend()
    assert backend.model_name == "engine-local/tiny-arith"
    assert backend.max_context_length == 256


def test_greedy_exact_rate_through_the_backend_is_in_band() -> None:
    """Re-measured with the backend's own batched sampler on the script's held-out set."""
    meta = json.loads((SHIPPED / make_model.METADATA_FILE).read_text())
    sft = meta["sft"]
    problems = make_model.eval_problems(sft["seed"] + 1, sft["eval_problems"])
    rate = greedy_exact_rate(new_backend(), None, problems)
    assert 0.2 <= rate <= 0.6
    assert rate == pytest.approx(meta["greedy_exact_rate"], abs=0.02)


def test_sampling_at_temperature_0_8_gives_integers_and_mixed_groups() -> None:
    backend = new_backend()
    problems = make_model.eval_problems(123, 32)
    jobs = [
        SampleJob(None, prompt_ids(backend, a, b), 6, 16, temperature=0.8, seed=i)
        for i, (a, b) in enumerate(problems)
    ]
    formatted = mixed = 0
    for res, (a, b) in zip(backend.sample(jobs), problems, strict=True):
        texts = [
            backend.tokenizer.decode(s.tokens, skip_special_tokens=True) for s in res.sequences
        ]
        formatted += sum(make_model.parse_int(t) is not None for t in texts)
        rewards = {make_model.quickstart_reward(t, a + b) for t in texts}
        mixed += len(rewards) > 1
    assert formatted / (6 * len(problems)) >= 0.9
    assert mixed / len(problems) >= 0.5


def test_quickstart_reward_matches_the_published_rule() -> None:
    reward = make_model.quickstart_reward
    assert reward("no digits", 50) == 0.0
    assert reward(" 50</s>", 50) == pytest.approx(1.0)
    assert reward(" 60", 50) == pytest.approx(0.2 + 0.5 * (1 - 10 / 50))
    assert reward(" -5 then 50", 50) == pytest.approx(0.2)  # first integer counts; far off
    assert reward(" 1000", 50) == pytest.approx(0.2)


def test_build_is_deterministic_per_seed() -> None:
    tok = make_model.build_tokenizer()
    shape = make_model.ModelShape()
    a, b, c = (make_model.build_model(tok, shape, seed) for seed in (0, 0, 1))
    sa, sb, sc = (m.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_cli_help_and_bad_arguments() -> None:
    cmd = [sys.executable, "-m", "scripts.make_model"]
    help_run = subprocess.run([*cmd, "--help"], capture_output=True, text=True, check=False)
    assert help_run.returncode == 0
    assert "--steps" in help_run.stdout and "--seed" in help_run.stdout
    bad = subprocess.run(
        [*cmd, "--target-rate", "0.9"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert "--target-rate must lie in [0.2, 0.6]" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_mix_flags_need_environments() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "scripts.make_model", "--tool-share", "0.5"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "--tool-share need --environments" in bad.stderr


def test_too_few_steps_fail_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as err:
        make_model.main(
            [
                "--environments",
                "--out",
                str(tmp_path / "m"),
                "--format-steps",
                "25",
                "--eval-every",
                "25",
                "--batch-size",
                "8",
            ]
        )
    assert "raise --format-steps" in str(err.value)
    assert not (tmp_path / "m").exists()


def test_a_few_default_sft_steps_rebuild_the_same_weights() -> None:
    """The default build's determinism, cheaply: the same seed trains the same bits on
    arithmetic rows only (no environment transcripts); another seed does not."""
    tok = make_model.build_tokenizer()
    cfg = make_model.SftConfig(batch_size=16, max_steps=3, eval_every=1000)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        model = make_model.build_model(tok, make_model.ModelShape(), seed)
        with pytest.raises(SystemExit, match="raise --steps"):  # no evaluation in 3 steps
            make_model.train(model, tok, dataclasses.replace(cfg, seed=seed))
        return model.state_dict()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build runs (the bits depend on the thread count)
    try:
        a, b, c = weights(0), weights(0), weights(1)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    ids, _ = make_model._arithmetic_batch(tok, random.Random(0), 64)
    text = tok.decode(ids.flatten().tolist())
    assert "+" in text and "Too " not in text and "<tool_call>" not in text


def test_a_few_agent_sft_steps_rebuild_the_same_weights() -> None:
    """The ``--environments`` build's determinism, cheaply: the same seed draws the same
    rows (every kind, chat transcripts included) and trains the same bits; another seed
    does not."""
    tok = make_model.build_tokenizer(make_model.AGENT_CHAT_TEMPLATE)
    mix = make_model.EnvMix(max_format_steps=3)
    cfg = make_model.SftConfig(batch_size=16, eval_every=1000, environments=mix)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        model = make_model.build_model(tok, make_model.ModelShape(), seed)
        with pytest.raises(SystemExit, match="raise --format-steps"):  # no evaluation in 3
            make_model.train(model, tok, dataclasses.replace(cfg, seed=seed))
        return model.state_dict()

    def rows(seed: int) -> list[list[torch.Tensor]]:
        batches = make_model._batch(tok, random.Random(seed), mix, 16, formats_only=False)
        return [list(b) for b in batches]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build runs (the bits depend on the thread count)
    try:
        a, b, c = weights(0), weights(0), weights(1)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    same, other = rows(0), rows(0)
    assert all(
        torch.equal(x, y)
        for bx, by in zip(same, other, strict=True)
        for x, y in zip(bx, by, strict=True)
    )
    text = tok.decode(torch.cat([ids.flatten() for ids, _ in same]).tolist())
    assert "Too " in text and "<tool_call>" in text and "+" in text  # every kind drawn


def test_the_agent_model_knows_the_environments_formats() -> None:
    """Re-measured on the packaged agent model's weights: tool calls to reinforce, tool
    results read back, hints followed (the floors the build enforces); still in the band
    on addition."""
    meta = json.loads((AGENT / make_model.METADATA_FILE).read_text())
    assert meta["model_name"] == make_model.AGENT_MODEL_NAME
    assert 0.2 <= meta["greedy_exact_rate"] <= 0.6
    assert (AGENT / "README.md").is_file()
    model = AutoModelForCausalLM.from_pretrained(AGENT)
    assert isinstance(model, LlamaForCausalLM)
    tok = make_model.build_tokenizer(make_model.AGENT_CHAT_TEMPLATE)
    stats = make_model.env_format_stats(model, tok, seed=7, n=16)
    for key, floor in make_model.ENV_FORMAT_FLOORS.items():
        assert meta["environments"][key] >= floor, key
        assert stats[key] >= floor / 2, key  # 16 fresh problems: a looser bar
    assert stats["tool_call_rate"] < 0.9  # RL still has tool use to learn


@pytest.mark.skipif(
    os.environ.get("ENGINE_TEST_REBUILD") != "1",
    reason="the full rebuild takes minutes of CPU; set ENGINE_TEST_REBUILD=1",
)
def test_default_build_rebuilds_a_model_in_the_band(tmp_path: Path) -> None:
    """What a user relies on, on any machine: the script rebuilds a model of the same shape
    and tokenizer whose greedy exact rate (re-measured through the backend) lies in the
    band. The exact bits only reproduce where the shipped model was built: float
    reductions differ across CPUs, so the SFT picks another step elsewhere. Opt-in: the
    build runs minutes (more on a loaded machine); test_a_few_sft_steps_rebuild_the_same_weights
    checks determinism in every run."""
    out = tmp_path / "rebuilt"
    make_model.main(["--out", str(out)])
    for name in ("tokenizer.json", "config.json"):
        assert (out / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    rebuilt = json.loads((out / make_model.METADATA_FILE).read_text())
    shipped = json.loads((SHIPPED / make_model.METADATA_FILE).read_text())
    assert rebuilt["parameters"] == shipped["parameters"]
    assert 0.2 <= rebuilt["greedy_exact_rate"] <= 0.6
    assert rebuilt["temperature_0_8"]["format_rate"] >= 0.9
    sft = rebuilt["sft"]
    problems = make_model.eval_problems(sft["seed"] + 1, sft["eval_problems"])
    rate = greedy_exact_rate(new_backend(out), None, problems)
    assert rate == pytest.approx(rebuilt["greedy_exact_rate"], abs=0.02)
    if rebuilt["built_on"] != shipped["built_on"]:
        return  # another CPU or torch: the same band, not the same bits
    assert (out / "model.safetensors").read_bytes() == (SHIPPED / "model.safetensors").read_bytes()
    for key in ("greedy_exact_rate", "temperature_0_8"):
        assert rebuilt[key] == shipped[key]
    assert sft["steps_done"] == shipped["sft"]["steps_done"]


def test_the_build_records_the_machine_that_decides_its_bits() -> None:
    machine = make_model.build_machine()
    assert machine["torch"] == torch.__version__
    assert set(machine) == {"torch", "cpu_capability", "machine", "processor", "cpu_flags_sha256"}
    for directory in (SHIPPED, AGENT):
        shipped = json.loads((directory / make_model.METADATA_FILE).read_text())
        assert set(shipped["built_on"]) == set(machine)


def test_the_default_model_records_no_environment_training() -> None:
    """The default build is addition only (its metadata has no mix and no environment
    rates); the agent model records both."""
    default = json.loads((SHIPPED / make_model.METADATA_FILE).read_text())
    agent = json.loads((AGENT / make_model.METADATA_FILE).read_text())
    assert "environments" not in default and "guess_share" not in default["sft"]
    assert set(make_model.sft_record(make_model.SftConfig())) | {"steps_done", "seconds"} == set(
        default["sft"]
    )
    mix = make_model.SftConfig(environments=make_model.EnvMix())
    assert set(make_model.sft_record(mix)) | {"steps_done", "seconds"} == set(agent["sft"])
    assert set(agent["environments"]) == set(make_model.ENV_FORMAT_FLOORS)
