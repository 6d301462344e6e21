"""Argument checks shared by every floor's public functions (one rule, one message)."""

from __future__ import annotations

import numpy as np


def bool_error(name: str, value) -> str | None:
    """The one-line error for a boolean option given anything but True or False (numpy's bool_ too), else None:
    Python's truthiness would read `compile="no"` or `share_weights="False"` as True and 0.5 as on."""
    if isinstance(value, (bool, np.bool_)):
        return None
    return f"{name} must be True or False (got {value!r} of type {type(value).__name__})"


def check_bools(**options) -> None:
    """Refuse, in one line naming it, before any work, a boolean option that is not True or False (bool_error)."""
    for name, value in options.items():
        if (err := bool_error(name, value)) is not None:
            raise ValueError(err)
