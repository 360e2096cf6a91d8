"""The latency profile through the SDK: clock-cycle behaviour (back-to-back
forward_backward + optim_step share one cycle; awaiting forward_backward first pushes
optim_step two cycles later), asserted on cycle numbers, never on wall time."""

from __future__ import annotations

import mint
from mint import types

from engine.local import LocalServer

QUESTION = "Question: What is 40 + 2?\nAnswer:"


def test_training_ops_follow_the_clock_cycles() -> None:
    # 10 s hosted cycles scaled to 0.2 s; after an idle period the first cycle starts at
    # least gather_s (0.2 s scaled) after a submission, so a back-to-back pair lands in it.
    with LocalServer(latency="mint:scale=0.02,gather_s=10") as server:
        service = mint.ServiceClient(base_url=server.base_url, api_key="tml-latency")
        tc = service.create_lora_training_client(base_model=server.model_name, rank=4)
        tokenizer = tc.get_tokenizer()
        full = tokenizer.encode(QUESTION + " 42")
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
            )
        ]
        adam = types.AdamParams(learning_rate=1e-3)

        # seq 1 + 2: submitted back to back, then awaited.
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
        fb.result()
        opt.result()
        # seq 3 + 4: forward_backward awaited before optim_step is submitted.
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()

        sampler = tc.save_weights_and_get_sampling_client()  # seq 5
        prompt = types.ModelInput.from_ints(tokenizer.encode(QUESTION))
        answer = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3)).result()
        assert len(answer.sequences) == 2  # the real model still computes every result

        stats = server.stats
        cycle = {op.seq_id: op.cycle for op in stats.op_cycles[tc.model_id]}
        assert cycle[2] == cycle[1]  # back to back: one cycle
        assert cycle[4] == cycle[3] + 2  # awaited: the step missed the next cycle
        assert cycle[3] > cycle[2] and cycle[5] > cycle[4]
        assert stats.cycles_started >= cycle[5] + 1
        assert stats.optimizer_steps == {tc.model_id: 2}
