"""Speculative decoding: a device's draft verified in one pass (``draft``, ``verify``) and the
engine's own prompt-lookup proposals (``ngram``); the scheduler's part is
``cloud_tier/engine/scheduling/speculation.py``."""
