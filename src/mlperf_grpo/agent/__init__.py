"""The software-repair agent: its tools (tools.py), the tool-call parser and the
multi-turn rollout loop. Torch-free where the engine is not needed."""
