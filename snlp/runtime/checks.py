"""Argument checks shared by every floor's public functions (one rule, one message)."""

from __future__ import annotations

import os

import numpy as np

# the environment variables snlp reads: name -> (the values it takes, the value when unset). A misspelt value is
# refused, never run as the default (snlp.decode.steps.default_guards, snlp.model.ops; the CLI checks them all
# before any work: check_environment)
ENV_CHOICES = {
    "SNLP_COMPILE_GUARDS": (("cut", "full"), "full"),
    "SNLP_WINDOW_ATTENTION": (("auto", "banded", "masked", "flex"), "auto"),
}


def env_choice(name: str) -> str:
    """The value of the environment variable `name` (one of ENV_CHOICES), its default when unset; a ValueError in
    one line naming the variable and the values it takes otherwise."""
    choices, default = ENV_CHOICES[name]
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r} (unset it for {default})")
    return value


def check_environment() -> None:
    """Refuse a misspelt value of any environment variable snlp reads (ENV_CHOICES), before any work."""
    for name in ENV_CHOICES:
        env_choice(name)


def bool_error(name: str, value) -> str | None:
    """The one-line error for a boolean option given anything but True or False (numpy's bool_ too), else None:
    Python's truthiness would read `compile="no"` or `share_weights="False"` as True and 0.5 as on."""
    if isinstance(value, (bool, np.bool_)):
        return None
    return f"{name} must be True or False (got {value!r} of type {type(value).__name__})"


def count_error(name: str, value, least: int | None = None) -> str | None:
    """The one-line error for a count given anything but a Python int (>= least), else None: a bool is an int, so
    steps=True ran as one step; a float passed `< 1` and failed deep in range() or torch; a numpy integer is refused
    by name (the budget arithmetic and the JSON records take Python ints)."""
    if isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least):
        return None
    kind = (f", a {type(value).__module__}.{type(value).__name__}: pass int(...)"
            if hasattr(value, "__index__") and not isinstance(value, (int, bool)) else "")
    return f"{name} must be an integer{'' if least is None else f' >= {least}'} (got {value!r}{kind})"


def check_count(value, name: str, least: int) -> None:
    """A ValueError naming `name` unless `value` is a Python int >= least (count_error)."""
    if (err := count_error(name, value, least)) is not None:
        raise ValueError(err)


def number_error(name: str, value) -> str | None:
    """The one-line error for a real-valued setting given a bool or no real number (a str, None), else None: True is
    1.0 to arithmetic, so lr=True trained at LR 1 and printed 'True'."""
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return None
    return f"{name} takes a number, not {value!r} of type {type(value).__name__}"


def check_bools(**options) -> None:
    """Refuse, in one line naming it, before any work, a boolean option that is not True or False (bool_error)."""
    for name, value in options.items():
        if (err := bool_error(name, value)) is not None:
            raise ValueError(err)
