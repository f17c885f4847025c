"""Evaluation: scoring answers, a generated task set, the ShareGPT workload, choosing the
cascade's thresholds, and a serving load generator. Used by ``cascade calibrate`` and bench/."""
