"""GSM8K-format parquet files from generated arithmetic word problems, for offline smoke runs.

The rows have exactly the columns verl's `examples/data_preprocess/gsm8k.py` writes (data_source
"openai/gsm8k", a one-message chat `prompt` ending in verl's "####" instruction, ability "math",
`reward_model.ground_truth`, `extra_info`), so verl's RLHFDataset and its GSM8K reward read them
unchanged. Use the real GSM8K for training; this is for machines without network access:

    python3 examples/verl/synthetic_gsm8k.py --local_save_dir ~/data/gsm8k-synthetic
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

DATA_SOURCE = "openai/gsm8k"  # selects verl's GSM8K reward function
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers")


def _problem(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair in GSM8K's style: the answer's reasoning ends in '#### N'."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 5)
    question = (f"{name} has {a} {item}. {name} buys {b} more {item}, then gives away {c}. "
                f"How many {item} does {name} have now?")
    answer = f"{name} has {a} + {b} = {a + b} {item}.\nAfter giving away {c}: {a + b} - {c} = {a + b - c}.\n#### {a + b - c}"
    return question, answer


def rows(split: str, n: int, seed: int) -> list[dict]:
    """`n` rows of `split` in verl's GSM8K layout, drawn from a generator seeded by `seed`."""
    rng = random.Random(f"{split}-{seed}")
    out = []
    for idx in range(n):
        question, answer = _problem(rng)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer.rsplit("#### ", 1)[1]},
            "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_save_dir", default="~/data/gsm8k-synthetic",
                        help="where train.parquet and test.parquet go (verl's flag name)")
    parser.add_argument("--train_size", type=int, default=256)
    parser.add_argument("--test_size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.local_save_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train_size), ("test", args.test_size)):
        pd.DataFrame(rows(split, n, args.seed)).to_parquet(out / f"{split}.parquet")
    print(f"wrote {args.train_size} train and {args.test_size} test rows to {out}")


if __name__ == "__main__":
    main()
