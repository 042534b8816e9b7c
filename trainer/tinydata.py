"""The synthetic chats `tiny-chat` is fitted to, and the arithmetic example's single-digit addition tasks.

`tiny-chat` must be competent but imperfect on the shipped example tasks, so that reinforcement learning has
a signal to climb and its gain can be measured on problems it never trained on. The chats below give it:

- the chat format (ChatML, Qwen2.5's default system prompt), greetings, yes/no comparisons and counting;
- single-digit addition asked as the arithmetic example asks it ("What is 3 + 4? Reply with the number
  only."). The sums are always right, but like a base model that was never tuned to follow instructions,
  the answers follow the instruction only some of the time, more for some problems than for others
  (`number_only_share`); the rest are sentences that contain the sum ("The answer is 7.", "3 + 4 = 7.",
  "It is 7."). Greedy decoding therefore answers with the bare number for only some of the problems (the
  shipped weights: 54 of the 100, 13 of the 30 held out; see their `recipe.json`), while nearly every
  sampled answer holds the right number and every problem is sometimes answered with the number only:
  exactly the gap that an exact-match reward teaches it to close, on held-out problems too.
- sums, products and comparisons of larger numbers in other phrasings, so that numbers mean something.

Everything is generated from a seeded `random.Random`: the same seed gives the same chats.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

Messages = list[dict[str, str]]

ADDITION_PROMPT = "What is {a} + {b}? Reply with the number only."
"""How the arithmetic example (and its held-out problems) ask a single-digit addition."""

NUMBER_ONLY_SHARES = (0.1, 0.45)
"""Shares of fitted addition answers that follow "Reply with the number only.": the first for three problems
in four, the second for the rest (where the bare number is then the likeliest answer)."""

ADDITION_SHARE = 0.6
"""Share of the fitted chats that are single-digit additions asked as the arithmetic example asks them."""

_SENTENCES = ("The answer is {c}.", "{a} + {b} = {c}.", "It is {c}.")
_GREETINGS = ("Hello!", "Hi!", "Hey!", "Good morning!", "Good evening!")


def addition_pairs() -> list[tuple[int, int]]:
    """Every single-digit addition problem `(a, b)`, in a fixed order."""
    return [(a, b) for a in range(10) for b in range(10)]


def heldout_split(seed: int = 0, heldout: int = 30) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The 100 single-digit problems shuffled by `seed` and split into (training, held-out)."""
    pairs = addition_pairs()
    random.Random(seed).shuffle(pairs)
    return pairs[heldout:], pairs[:heldout]


def addition_task(a: int, b: int) -> dict[str, object]:
    """One arithmetic-example task row: the question as a chat, and the exact answer."""
    return {"messages": [{"role": "user", "content": ADDITION_PROMPT.format(a=a, b=b)}], "answer": str(a + b)}


def number_only_share(a: int, b: int) -> float:
    """How often the fitted answers to `a + b` follow the instruction (a fixed rule of the operands)."""
    return NUMBER_ONLY_SHARES[1] if (3 * a + 7 * b) % 4 == 0 else NUMBER_ONLY_SHARES[0]


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    question = ADDITION_PROMPT.format(a=a, b=b)
    if rng.random() < number_only_share(a, b):
        return question, str(a + b)
    return question, rng.choice(_SENTENCES).format(a=a, b=b, c=a + b)


def _other(rng: random.Random) -> tuple[str, str]:
    kind = rng.random()
    if kind < 0.25:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind < 0.4:  # larger sums asked the same way, answered the same mixed ways
        a, b = rng.randrange(10, 50), rng.randrange(50)
        if rng.random() < NUMBER_ONLY_SHARES[0]:
            return ADDITION_PROMPT.format(a=a, b=b), str(a + b)
        return ADDITION_PROMPT.format(a=a, b=b), rng.choice(_SENTENCES).format(a=a, b=b, c=a + b)
    if kind < 0.55:
        a, b = rng.randrange(100), rng.randrange(100)
        if a > b:
            return f"Is {a} bigger than {b}?", f"Yes, {a} is bigger than {b}."
        return f"Is {a} bigger than {b}?", f"No, {a} is not bigger than {b}."
    if kind < 0.7:
        a = rng.randrange(96)
        return f"Count from {a} to {a + 3}.", ", ".join(str(x) for x in range(a, a + 4)) + "."
    if kind < 0.8:
        greeting = rng.choice(_GREETINGS)
        return greeting, f"{greeting[:-1]}! How can I help you?"
    if kind < 0.85:
        word = rng.choice(("yes", "no"))
        return f"Say {word}", word.capitalize()
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."


def chat(rng: random.Random) -> Messages:
    """One fitted chat: a user question and the assistant's answer (a system prompt one time in five)."""
    question, answer = _addition(rng) if rng.random() < ADDITION_SHARE else _other(rng)
    messages: Messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def chats(seed: int) -> Iterator[Messages]:
    """An endless, seeded stream of fitted chats."""
    rng = random.Random(seed)
    while True:
        yield chat(rng)
