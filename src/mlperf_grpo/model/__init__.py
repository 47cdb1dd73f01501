"""The model: its files read without weights, its skeleton, loading, checks, compile, fingerprints."""
