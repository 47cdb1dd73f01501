"""The log side (torch-free): the MLPerf log, its values, merge, check, report, package."""
