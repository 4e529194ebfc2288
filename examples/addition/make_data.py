"""Write the built-in addition task as plain files: train.jsonl (every pair a, b < 100, standard prompts
"<bos>a+b=" with an `answer` column) and eval.jsonl (128 fixed problems). The tiny model's character
tokenizer reads these prompts as they are; its eos ends an answer.

    python examples/addition/make_data.py        # then: minite train --config examples/addition/run.toml
"""
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent


def row(a: int, b: int) -> dict:
    return {"prompt": f"<bos>{a}+{b}=", "answer": str(a + b), "data_source": "addition"}


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    rng = random.Random(1234)
    with (out / "train.jsonl").open("w") as f:
        for a in range(100):
            for b in range(100):
                f.write(json.dumps(row(a, b)) + "\n")
    with (out / "eval.jsonl").open("w") as f:
        for _ in range(128):
            f.write(json.dumps(row(rng.randrange(100), rng.randrange(100))) + "\n")
    print(f"wrote {out / 'train.jsonl'} and {out / 'eval.jsonl'}")
