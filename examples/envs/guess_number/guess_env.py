"""Multi-turn guessing game: the model guesses, the environment answers "higher" or "lower".

Reward: 1.0 for finding the number on the first turn, 0.15 less for each further turn (never below
0.1); 0 when the turns run out. A reply without a number costs a turn and gets a reminder.
"""

import re

from envsdk import MultiTurnEnv, StepResult, task_messages

NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv(MultiTurnEnv):
    max_turns = 6

    def reset(self, task: dict) -> list[dict]:
        self.target = int(task["target"])
        self.turns = 0
        return task_messages(task)

    def step(self, assistant_message: dict) -> StepResult:
        self.turns += 1
        found = NUMBER.findall(assistant_message.get("content") or "")
        if not found:
            return StepResult(observation=[{"role": "user", "content": "Please reply with a number."}])
        guess = int(found[-1])
        if guess == self.target:
            reward = max(0.1, 1.0 - 0.15 * (self.turns - 1))
            return StepResult(reward=reward, done=True, info={"turns": self.turns})
        hint = "higher" if guess < self.target else "lower"
        return StepResult(observation=[{"role": "user", "content": f"{guess} is wrong: go {hint}."}])
