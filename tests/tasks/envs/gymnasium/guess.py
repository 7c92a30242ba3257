"""A Gymnasium text environment written to the standard (gymnasium.Env, registered with
gymnasium.register), for the adapter's tests: guess a number that is one of two the
observation names. A wrong guess costs -0.1 and answers "lower" or "higher"; the right one ends
the episode with 1.0; after `max_episode_steps` guesses the TimeLimit wrapper truncates it.
`actions="text"` takes the guess as digits (a Text space), "discrete" as an integer 1..20."""

import string

import gymnasium
from gymnasium import spaces


class GuessNumber(gymnasium.Env):
    def __init__(self, actions: str = "text") -> None:
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = (spaces.Text(max_length=2, charset=string.digits) if actions == "text"
                             else spaces.Discrete(20, start=1))
        self.target = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(1, 19))
        return f"Guess my number: it is {self.target} or {self.target + 1}.", {}

    def step(self, action):
        guess = int(action)
        if guess == self.target:
            return "Right!", 1.0, True, False, {}
        return ("lower" if guess > self.target else "higher"), -0.1, False, False, {}


if "forgerl-test/GuessNumber-v0" not in gymnasium.registry:  # imported once per adapter
    gymnasium.register("forgerl-test/GuessNumber-v0", entry_point=GuessNumber,
                       max_episode_steps=2)
