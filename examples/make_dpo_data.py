"""Write examples/dpo_repeat.jsonl: preference pairs "Repeat 47." -> chosen "47",
rejected another two-digit number, one pair per line, for ``--objective dpo``
(docs/dpo.md). The packaged model was trained on "What is A + B?" only and prefers
neither answer; DPO teaches it to prefer the repeated number.

    python examples/make_dpo_data.py    # the committed file: 400 pairs, seed 0
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("dpo_repeat.jsonl")


def main(rows: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    with OUT.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            number = rng.randint(10, 99)
            other = rng.choice([n for n in range(10, 100) if n != number])
            pair = {"prompt": f"Repeat {number}.", "chosen": str(number), "rejected": str(other)}
            f.write(json.dumps(pair) + "\n")


if __name__ == "__main__":
    main()
