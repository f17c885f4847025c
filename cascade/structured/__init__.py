"""Structured outputs and tool calls, the same on both tiers: the request's contract
(``contract``), its grammar for llguidance (``grammar``), compiled grammars and the per-step token
mask (``matcher``), tool calls in the model's text (``tools``) and the check of a finished answer
(``validate``)."""
