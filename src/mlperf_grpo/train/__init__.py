"""GRPO: rollouts, advantages and loss, and the training loop."""
