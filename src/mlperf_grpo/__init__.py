"""mlperf-grpo: GRPO training with deferred offline evaluation for MLPerf qwen35_397b_grpo."""

__version__ = "0.1.0"
