"""Argument checks shared by every floor's public functions (one rule, one message)."""

from __future__ import annotations

import numpy as np


def check_bools(**options) -> None:
    """Refuse a boolean option given anything but True or False (numpy's bool_ too), in one line naming it, before
    any work: Python's truthiness would read `compile="no"` or `share_weights="False"` as True and 0.5 as on."""
    for name, value in options.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False (got {value!r} of type {type(value).__name__})")
