"""The run's configuration: its sections, the whole run, YAML in and out, the run directory."""
