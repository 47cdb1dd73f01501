"""A reward returning values of many types, for the scoring tests (a worker imports it by
name; numpy and torch are imported with the module, under the pool's load bound, not
inside a call's timeout)."""

from fractions import Fraction

import numpy
import torch

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "numpy-nan": numpy.float64("nan"),
          "torch-inf": torch.tensor(float("inf")), "10**400": 10**400, "str": "1.0", "none": None, "list": [1.0],
          "complex": 1j, "one": 1, "true": True, "half": Fraction(1, 2), "numpy": numpy.float32(0.25),
          "torch": torch.tensor(0.75), "-2.5": -2.5}
"""name -> a reward value."""


def value_reward(completion, task):
    """Returns the value the completion names (a key of :data:`VALUES`)."""
    return VALUES[completion]
