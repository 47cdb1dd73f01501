"""Offline evaluation: the validator (pass@k of one checkpoint) and the driver."""
