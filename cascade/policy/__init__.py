"""The cascade's decisions, as pure functions: which tier answers a request and why.

Each signal has its own module (``hard``, ``overflow``, ``confidence``, ``backpressure``);
``decide`` combines them into one ``Decision`` with a reason code. Nothing here does I/O: the
edge agent measures the signals and acts on the decision.
"""

from cascade.policy.decide import Decision, PolicyConfig, RequestSignals, decide

__all__ = ["Decision", "PolicyConfig", "RequestSignals", "decide"]
