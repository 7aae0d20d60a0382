"""Option checks shared by the engines, the strategies, the callbacks and the recipes.

Each raises ``ValueError`` with a message that names the option (and, where
given, its owner), so that a bad value fails at construction, before any rank
trains. Pure Python: importable without Lightning.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import TypeGuard, Union


def is_finite_number(value: object) -> TypeGuard[Union[int, float]]:
    """Whether ``value`` is a finite ``int`` or ``float`` (not a ``bool``, a NaN or an infinity)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_int_at_least(value: object, minimum: int) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) ``>= minimum``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def check_int(name: str, value: object, *, minimum: int = 1, optional: bool = False, owner: str = "") -> None:
    """Raises unless ``value`` is an integer ``>= minimum`` (or ``None`` if ``optional``).

    The message: ``"[owner: ]name must be an integer >= minimum[ or None], got value"``.
    """
    if optional and value is None:
        return
    if not is_int_at_least(value, minimum):
        prefix = f"{owner}: " if owner else ""
        raise ValueError(
            f"{prefix}{name} must be an integer >= {minimum}{' or None' if optional else ''}, got {value!r}"
        )


def check_timedelta(name: str, value: object, *, optional: bool = False) -> None:
    """Raises unless ``value`` is a positive ``timedelta`` of at most ``threading.TIMEOUT_MAX`` seconds (or ``None``
    if ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ValueError(f"{name} must be a positive datetime.timedelta{' or None' if optional else ''}, got {value!r}")
    if value.total_seconds() > threading.TIMEOUT_MAX:
        # Every wait bounded by it passes it on to a lock or an event, which refuse more (OverflowError) in
        # whichever thread waits: at construction instead.
        raise ValueError(f"{name} must be at most threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:.0f} s), got {value!r}")
