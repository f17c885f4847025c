"""Test doubles shared by the sync tests."""


class FakeClock:
    """A clock that moves only when a test moves it: ``clock.t += 5``."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
