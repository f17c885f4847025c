"""Staged rollouts: the spec, typed states and transitions, the store, the controller, the judge."""
