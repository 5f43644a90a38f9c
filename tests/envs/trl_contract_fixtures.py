"""Classes written to TRL's environment contract, as a user would write them (no rllight import)."""


class Counter:
    """Reach the row's ``target`` (else its ``answer``) with the ``increment`` tool, then answer."""

    def __init__(self):
        self.value = 0
        self.target = None

    def reset(self, target: int | None = None, answer: str | None = None, **kwargs) -> str:
        self.value, self.target = 0, int(target if target is not None else answer)
        return f"Reach {self.target}."

    def increment(self, a: int) -> int:
        """
        Add to the counter.

        Args:
            a: How much to add.

        Returns:
            The counter after the addition.
        """
        if a < 0:
            raise ValueError("a must be >= 0")
        self.value += a
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0


class NoArgsReset(Counter):
    """``reset`` without arguments (TRL's demo environments have one)."""

    def reset(self) -> None:
        self.value, self.target = 0, 2


class NoReward:
    def reset(self, **kwargs) -> None:
        pass


class NoisyCounter(Counter):
    """``Counter`` whose reward differs between episodes whatever the model does (a random model never reaches
    the target): the rewards of a group vary, so an update has something to learn from."""

    def get_reward(self) -> float:
        import random

        return random.random()


def make_counter() -> Counter:
    """A function that makes the environment and says so by its return annotation."""
    return Counter()


def write_probe(path: str, text: str = "ran") -> None:
    """Writes ``path``: a function that makes no environment, which a recipe's ``factory`` must not get to call."""
    with open(path, "w") as f:
        f.write(text)


class Runner:
    """A class of the user's that is no environment (no ``reset``); constructing it writes ``path``."""

    def __init__(self, path: str = "probe"):
        with open(path, "w") as f:
            f.write("ran")

    def get_reward(self) -> float:
        return 0.0
