"""The mlperf-grpo command line: parser, requests, the library entry of each command.

``main`` (in :mod:`mlperf_grpo.cli.app`) is the ``mlperf-grpo`` entry point."""

from mlperf_grpo.cli.app import main

__all__ = ["main"]
