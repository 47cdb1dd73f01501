"""Plans without running: closed-division values of a GBS, per-rank memory of a layout."""
