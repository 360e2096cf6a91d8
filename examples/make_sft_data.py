"""Write examples/sft_plus_words.jsonl: sums asked in words ("What is 12 plus 30?"), one
conversation per line, for supervised fine-tuning (docs/sft.md). The packaged model
was trained on "What is A + B?" only and answers these poorly; SFT teaches them.

    python examples/make_sft_data.py    # the committed file: 400 rows, seed 0
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("sft_plus_words.jsonl")


def main(rows: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    with OUT.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            messages = [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    main()
