"""engine.export: a local-server checkpoint as a PEFT adapter and as merged weights, both
loaded by transformers/PEFT and checked against the server's own forward.

Tolerance: every target-token logprob agrees with the backend's within 1e-4 (absolute;
float32 with a different summation order, and the merged weights round W + BA once)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine.basemodels.recommended import served_model_name
from engine.checkpoint_files import resolve_checkpoint
from engine.errors import ConfigError
from engine.export import export_checkpoint, main
from engine.local.compute.backend import Backend
from engine.local.compute.backend_types import AdamConfig, AdapterSpec, DatumIn
from engine.rundir.directory import LOCAL_SERVER_DIR
from tests.backend_util import MODEL_DIR, random_datums

LOGPROB_TOLERANCE = 1e-4
Trained = tuple[Path, list[list[int]], list[torch.Tensor]]


def _train(backend: Backend, steps: int = 3) -> list[list[int]]:
    backend.create_model("run", AdapterSpec(rank=4, seed=0))
    seqs = random_datums(backend, 4, seed=1)
    data = [
        DatumIn(
            s[:-1],
            {"target_tokens": torch.tensor(s[1:]), "weights": torch.ones(len(s) - 1)},
        )
        for s in seqs
    ]
    for _ in range(steps):
        backend.forward_backward("run", data, "cross_entropy", None, backward=True)
        backend.optim_step("run", AdamConfig(learning_rate=1e-2))
    return seqs


def _target_logprobs(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    backend = Backend(MODEL_DIR)
    seqs = _train(backend)
    ckpt = tmp_path_factory.mktemp("data") / "run" / "weights" / "final"
    backend.save_state("run", ckpt)
    data = [
        DatumIn(s[:-1], {"target_tokens": torch.tensor(s[1:]), "weights": torch.ones(len(s) - 1)})
        for s in seqs
    ]
    served = backend.forward_backward("run", data, "cross_entropy", None, backward=False)
    return ckpt, seqs, [o["logprobs"] for o in served.outputs]


def test_peft_export_matches_the_servers_forward(trained: Trained, tmp_path: Path) -> None:
    ckpt, seqs, served = trained
    out = tmp_path / "adapter"
    assert main([str(ckpt), "--format", "peft", "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32
    # the model id, not a path of this machine (the adapter loads elsewhere)
    assert config["base_model_name_or_path"] == served_model_name(MODEL_DIR)
    assert config["revision"] is None
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    untrained = [_target_logprobs(base, s) for s in seqs]
    model = PeftModel.from_pretrained(base, str(out)).eval()
    for seq, want, before in zip(seqs, served, untrained, strict=True):
        got = _target_logprobs(model, seq)
        assert torch.allclose(got, want, atol=LOGPROB_TOLERANCE, rtol=0)
        assert not torch.allclose(before, want, atol=1e-2)  # the LoRA really changed it


def test_a_local_base_path_and_a_revision_are_explicit(trained: Trained, tmp_path: Path) -> None:
    ckpt, _, _ = trained
    named = tmp_path / "named"
    args = [str(ckpt), "--out", str(named), "--base-model", "org/base", "--revision", "abc123"]
    assert main(args) == 0
    config = json.loads((named / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("org/base", "abc123")
    local = tmp_path / "local"
    assert main([str(ckpt), "--out", str(local), "--base-path", str(MODEL_DIR)]) == 0
    config = json.loads((local / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(MODEL_DIR).resolve())


def test_merged_export_matches_the_servers_forward(trained: Trained, tmp_path: Path) -> None:
    ckpt, seqs, served = trained
    out = tmp_path / "merged"
    export_checkpoint(ckpt, out, "merged")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for seq, want in zip(seqs, served, strict=True):
        assert torch.allclose(_target_logprobs(model, seq), want, atol=LOGPROB_TOLERANCE, rtol=0)


def test_the_docs_load_both_exports_from_any_directory(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loading snippet of docs/export-and-eval.md, run where the exports are and not
    in the repository: the base model comes from the adapter's own base id, not from a
    path relative to a checkout (``engine/local/default_model``)."""
    ckpt, seqs, served = trained
    assert main([str(ckpt), "--format", "peft", "--out", str(tmp_path / "adapter")]) == 0
    export_checkpoint(ckpt, tmp_path / "merged", "merged")
    page = (Path(__file__).resolve().parents[1] / "docs" / "export-and-eval.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.DOTALL | re.MULTILINE)
    snippet = next(b for b in blocks if "PeftModel.from_pretrained" in b)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(snippet, namespace)
    assert Path(namespace["BASE"]) == Path(MODEL_DIR)
    for name in ("adapter", "model"):
        model = namespace[name].float().eval()
        for seq, want in zip(seqs, served, strict=True):
            got = _target_logprobs(model, seq)
            assert torch.allclose(got, want, atol=LOGPROB_TOLERANCE, rtol=0)


def test_a_run_dir_names_its_checkpoints_in_its_local_server_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step, name in ((2, "ckpt-2"), (4, "final")):
        directory = run / LOCAL_SERVER_DIR / "model-1" / "weights" / name
        directory.mkdir(parents=True)
        (directory / "meta.json").write_text("{}")
        with (run / "checkpoints.jsonl").open("a") as f:
            path = f"tinker://model-1/weights/{name}"
            f.write(json.dumps({"step": step, "state_path": path}) + "\n")
    last = resolve_checkpoint(str(run))
    assert last.step == 4 and last.directory == run / LOCAL_SERVER_DIR / "model-1/weights/final"
    assert resolve_checkpoint(str(run), step=2).tinker_path == "tinker://model-1/weights/ckpt-2"
    with pytest.raises(ConfigError, match=r"no checkpoint of step 3 \(it has steps 2, 4\)"):
        resolve_checkpoint(str(run), step=3)


def test_bad_checkpoints_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err


def test_a_tinker_path_elsewhere_is_downloaded_through_the_sdk_archive_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mint
    from safetensors.torch import load_file

    from engine.local import LocalServer

    with LocalServer(api_key="tml-export-test") as server:
        service = mint.ServiceClient(base_url=server.base_url, api_key="tml-export-test")
        training = service.create_lora_training_client(base_model=server.model_name, rank=2)
        path = training.save_state("exported").result().path
        monkeypatch.setenv("MINT_API_KEY", "tml-export-test")
        out = tmp_path / "adapter"
        args = [path, "--format", "peft", "--out", str(out), "--base-url", server.base_url]
        assert main(args) == 0
        served = resolve_checkpoint(path, data_dir=server.data_dir).directory
        assert served is not None
        saved = load_file(str(served / "adapter.safetensors"))
    exported = load_file(str(out / "adapter_model.safetensors"))
    assert exported.keys() == {"base_model.model." + key for key in saved}
    for key, tensor in saved.items():
        assert torch.equal(exported["base_model.model." + key], tensor)
