"""mlperf-grpo report: the timeline of a log as PNG or HTML."""
