"""Write examples/sft_repeat.jsonl: "Repeat 47." answered "47", one conversation per
line, for supervised fine-tuning (docs/sft.md). The packaged model was trained on
"What is A + B?" only and answers none of these; SFT teaches them.

Also examples/rl_repeat.jsonl: the same prompts as an RL task, each number 10..99 once
with its answer (``reward=exact``), for the RL stage of SFT then RL (docs/sft.md).

    python examples/make_sft_data.py    # the committed files: 400 rows, seed 0; 90 rows
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("sft_repeat.jsonl")
RL_OUT = Path(__file__).with_name("rl_repeat.jsonl")


def main(rows: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    with OUT.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            number = rng.randint(10, 99)
            messages = [
                {"role": "user", "content": f"Repeat {number}."},
                {"role": "assistant", "content": str(number)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    with RL_OUT.open("w", encoding="utf-8") as f:
        for number in range(10, 100):
            prompt = [{"role": "user", "content": f"Repeat {number}."}]
            f.write(json.dumps({"messages": prompt, "answer": str(number)}) + "\n")


if __name__ == "__main__":
    main()
