"""The unmodified tinker 0.38 SDK against a local server: train a step, then sample.
Start a server (`python -m engine.local --port 8765`), then in the .venv-tinker env:
  TINKER_API_KEY=tml-local .venv-tinker/bin/python examples/tinker038_smoke.py http://127.0.0.1:8765
"""

import sys

import tinker
from tinker import types

service = tinker.ServiceClient(base_url=sys.argv[1])
model = tinker.RestClient(base_url=sys.argv[1]).get_server_capabilities().result()
model_name = model.supported_models[0].model_name or ""
training = service.create_lora_training_client(base_model=model_name, rank=8).result()
tokens = training.get_tokenizer().encode("Question: What is 12 + 30?\nAnswer: 42")
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
        "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
    },
)
loss = training.forward_backward([datum], "cross_entropy")
step = training.optim_step(types.AdamParams(learning_rate=1e-3))
print("loss:sum", loss.result().metrics["loss:sum"], "optim", step.result().metrics)
sampler = training.save_weights_and_get_sampling_client().result()
prompt = types.ModelInput.from_ints(tokens[:8])
sample = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, seed=0)).result()
print("sampled", [(s.sequence_id, s.tokens) for s in sample.sequences])
service.close("success").result()
