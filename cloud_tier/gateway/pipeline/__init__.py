"""One request's pipeline: its flight, the steps by worker kind, settlement, typed results."""
