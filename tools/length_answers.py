"""What a retrieval policy answers on held-out prompts: the queried fact's value, a distractor's value, another answer.

For each trainer run directory given (its latest checkpoint and options, as `python -m longstraw_jax.evaluate
--resume OUT`), scores its held-out prompts greedily and splits the first response token by what it matches, over the
prompts where some distractor's value differs from the queried fact's (there a policy that copies a random fact's
value answers a distractor's value about as often as the right one; one that matches the key answers the right one):

    correct          the queried fact's value
    distractor       the value of another fact (not equal to the answer)
    other answer     an answer id that no fact in the prompt holds
    not an answer    anything else

    python tools/length_answers.py out/bench_length/exact-seed0 out/bench_length/detached-seed0

Prints one markdown row per run; with --json FILE also writes the counts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

from longstraw_jax.tasks.retrieval import FACT, FIRST_ANSWER, RetrievalTask
from longstraw_jax.trainer import evaluate
from longstraw_jax.trainer.config import saved_run_config


def classify(task: RetrievalTask, answers: list[dict]) -> dict[str, int]:
    """answers: evaluate's per-prompt records (index, response, info) of `task`'s prompts -> counts over the prompts
    with a distractor value different from the answer."""
    counts = {"prompts": 0, "correct": 0, "distractor": 0, "other answer": 0, "not an answer": 0}
    for a in answers:
        prompt = task.prompt(a["index"])
        assert prompt.info == a["info"], f"prompt {a['index']}: not the evaluator's held-out prompt"
        tokens = prompt.tokens[:-2]
        values = {int(tokens[i + 2]) for i in np.flatnonzero(tokens == FACT) if i + 2 < len(tokens)}
        answer = a["info"]["answer"]
        if not values - {answer}:
            continue
        counts["prompts"] += 1
        first = a["response"][0] if a["response"] else -1
        if first == answer:
            counts["correct"] += 1
        elif first in values:
            counts["distractor"] += 1
        elif FIRST_ANSWER <= first < task.first_key:
            counts["other answer"] += 1
        else:
            counts["not an answer"] += 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="trainer run directories (--out)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = {}
    print("| run | prompts (a distractor's value != the answer) | correct | distractor's value | other answer | "
          "not an answer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for out in args.runs:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "answers.json")
            status = evaluate.main(["--resume", out, "--json", path])
            if status:
                return status
            with open(path) as f:
                result = json.load(f)
        with open(os.path.join(out, "config.json")) as f:
            config = saved_run_config(json.load(f), os.path.join(out, "config.json"))  # saved as --facts too
        task = evaluate.held_out_task(config, config.vocab_size)  # the prompts the evaluation above scored
        counts = rows[out] = classify(task, result["answers"])
        n = max(counts["prompts"], 1)
        print(f"| {out} | {counts['prompts']} | " + " | ".join(f"{counts[k] / n:.3f}" for k in
                                                                ("correct", "distractor", "other answer",
                                                                 "not an answer")) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
