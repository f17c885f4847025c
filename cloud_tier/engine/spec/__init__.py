"""Speculative decoding: a device's draft (``cloud_tier/engine/draft.py``) verified in one pass
(``verify``), the engine's own prompt-lookup proposals (``ngram``) and the engine's side of both
(``speculation``); the scheduler's part is ``cloud_tier/engine/scheduling/speculation.py``."""
