"""Writes the example task: short reviews labelled positive or negative.

Small enough that the built-in `tiny` model learns it in about a minute on two CPU
cores, and the held-out split (different sentences from the same words) shows whether
it learned the task rather than the rows. Run again to regenerate the same files (and
examples/smollm2/'s train, eval and batch files, the same task drawn with another seed).
"""

import json
import random
from pathlib import Path

SUBJECTS = ["the movie", "the food", "this phone", "the hotel", "the book", "the service", "the concert", "this game",
            "the coffee", "the show", "the trip", "the class", "the app", "the car", "the album", "the room"]
POSITIVE = ["great", "wonderful", "excellent", "amazing", "lovely", "fantastic", "delightful", "superb", "brilliant", "good"]
NEGATIVE = ["terrible", "awful", "horrible", "boring", "dreadful", "bad", "poor", "disappointing", "nasty", "weak"]
FRAMES = ["{s} was {w}.", "I found {s} {w}.", "Honestly, {s} was {w}.", "{s} felt {w} to me.", "We thought {s} was {w}."]
QUESTION = "Is this review positive or negative? Answer with one word.\n\n{review}"


def rows(rng: random.Random):
    seen = set()
    while True:
        label = rng.choice(["positive", "negative"])
        word = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
        review = rng.choice(FRAMES).format(s=rng.choice(SUBJECTS), w=word)
        review = review[0].upper() + review[1:]
        if review in seen:
            continue
        seen.add(review)
        yield review, label


def main(out: Path = Path(__file__).parent, seed: int = 1234, names=("train", "evals", "prompts")) -> None:
    gen = rows(random.Random(seed))
    pairs = [next(gen) for _ in range(320)]
    train, evals, prompts = pairs[:200], pairs[200:260], pairs[260:]
    with open(out / f"{names[0]}.jsonl", "w") as f:
        for review, label in train:
            msgs = [{"role": "user", "content": QUESTION.format(review=review)}, {"role": "assistant", "content": label}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(out / f"{names[1]}.jsonl", "w") as f:
        for i, (review, label) in enumerate(evals):
            f.write(json.dumps({"custom_id": f"eval-{i:03d}", "body": {"messages": [{"role": "user", "content": QUESTION.format(review=review)}],
                                "max_tokens": 8}, "expected": label}) + "\n")
    with open(out / f"{names[2]}.jsonl", "w") as f:
        for i, (review, _) in enumerate(prompts):
            f.write(json.dumps({"custom_id": f"prompt-{i:03d}", "body": {"messages": [{"role": "user", "content": QUESTION.format(review=review)}],
                                "max_tokens": 8}}) + "\n")


if __name__ == "__main__":
    main()
    # The real-model walk-through's copy: the same task drawn with another seed (examples/smollm2/).
    main(Path(__file__).parents[1] / "smollm2", seed=77, names=("train", "eval", "batch"))
