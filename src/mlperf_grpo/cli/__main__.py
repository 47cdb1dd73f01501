"""``python -m mlperf_grpo.cli``: the mlperf-grpo command."""

import sys

from mlperf_grpo.cli import main

sys.exit(main())
