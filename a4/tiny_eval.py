"""Does the trained tiny Qwen3.5 know its own world? Every question its corpus can ask, asked through a4.

    python -m a4.tiny_eval [--model-dir DIR] [--misses N]

Each (question, answer) of `tiny_corpus.QUESTIONS` (capitals, animal sounds, fruit colours, days, numbers and every
sum and difference the corpus writes) is asked as a one-turn chat in the checkpoint's chat template, greedy through
a4's engine (`LLM`); the answer is right when the text before `<|im_end|>` is exactly the corpus's answer sentence.
Prints the accuracy of each category and the first misses; tests/test_trained_checkpoint.py holds the shipped
checkpoint to ACCURACY_BAR.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from a4 import tiny_corpus

ACCURACY_BAR = 0.98  # of all the questions together (issue 39)
ANSWER_TOKENS = 24  # the longest answer sentence is ~12 tokens; room to see what a wrong one goes on with


@dataclass(frozen=True)
class Answer:
    category: str
    question: str
    expected: str
    said: str

    @property
    def right(self) -> bool:
        return self.said == self.expected


def ask_every_question(model_dir: Path, **llm_options) -> list[Answer]:
    """Every question of the corpus's world, as a one-turn chat, greedy through a4; what the model said to each."""
    from a4 import LLM, SamplingParams
    from a4.__main__ import chat_text, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    asked = [(category, q, a) for category, pairs in tiny_corpus.QUESTIONS.items() for q, a in pairs]
    prompts = [tokenizer.encode(chat_text(tokenizer, question)) for _, question, _ in asked]
    outputs = LLM(model_dir, **llm_options).generate(prompts, SamplingParams(max_new_tokens=ANSWER_TOKENS))
    return [
        Answer(category, question, expected, tokenizer.decode(out.token_ids).split(tiny_corpus.IM_END)[0])
        for (category, question, expected), out in zip(asked, outputs)
    ]


def accuracy(answers: list[Answer]) -> dict[str, tuple[int, int]]:
    """(right, asked) of each category, and of all of them under "all"."""
    counts = {category: [0, 0] for category in (*tiny_corpus.QUESTIONS, "all")}
    for answer in answers:
        for key in (answer.category, "all"):
            counts[key][0] += answer.right
            counts[key][1] += 1
    return {key: (right, asked) for key, (right, asked) in counts.items()}


def main(argv: list[str] | None = None) -> int:
    from a4.checkpoints import tiny_checkpoint

    parser = argparse.ArgumentParser(prog="python -m a4.tiny_eval", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="a checkpoint (default: the trained tiny Qwen3.5)")
    parser.add_argument("--misses", type=int, default=10, help="how many wrong answers to print")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or tiny_checkpoint("qwen3_5", trained=True)
    answers = ask_every_question(model_dir)
    for key, (right, asked) in accuracy(answers).items():
        print(f"{key:>14}  {right:>3} / {asked:<3}  {right / asked:6.1%}")
    for answer in [a for a in answers if not a.right][: args.misses]:
        print(f"  miss: {answer.question!r} -> {answer.said!r} (expected {answer.expected!r})")
    right, asked = accuracy(answers)["all"]
    return 0 if right >= ACCURACY_BAR * asked else 1


if __name__ == "__main__":
    raise SystemExit(main())
