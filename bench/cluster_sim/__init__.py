"""Discrete-event cluster simulator driving the scheduler's real policies (issue 16)."""
