"""Speculative decoding: proposals (n-gram prompt lookup, or a draft model) verified k + 1 rows at a time by the
target with rejection sampling. See speculator.py for how a step runs, rejection.py for the verification rule."""
