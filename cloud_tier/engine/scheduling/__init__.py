"""The scheduler's passes and the values they share: one module per decision."""
