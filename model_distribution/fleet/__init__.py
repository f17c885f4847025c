"""The fleet's devices: enrolment, desired state, what they report, and the operator's operations."""
