"""Single-turn arithmetic: 1.0 for exactly the answer, partial credit for the right number or for digits.

The shaping (0.5 when the right number appears somewhere, 0.1 for any digits) gives a tiny model a
gradient to climb long before it answers exactly.
"""

import re

from envsdk import SingleTurnEnv, completion_text

NUMBER = re.compile(r"-?\d+")


class ArithmeticEnv(SingleTurnEnv):
    def reward(self, task: dict, completion) -> float:
        text = completion_text(completion).strip()
        answer = str(task["answer"]).strip()
        if text == answer:
            return 1.0
        if not self.config.get("partial_credit", True):
            return 0.0
        numbers = NUMBER.findall(text)
        if answer in numbers:
            return 0.5
        return 0.1 if numbers else 0.0
