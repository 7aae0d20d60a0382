"""Option checks shared by the data modules, models and the CLI: every error names its option."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Optional

from lightning_partial.collectives.checks import is_int_at_least


class RecipeConfigError(ValueError):
    """A bad option value. ``option`` is the CLI key (``data.batch_size``); ``str()`` names it first."""

    def __init__(self, option: str, message: str) -> None:
        self.option = option
        self.message = message
        super().__init__(f"--{option}: {message}")


def check_int(value: Any, option: str, *, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` (bools refused)."""
    if not is_int_at_least(value, minimum):
        raise RecipeConfigError(option, f"must be an integer >= {minimum}, got {value!r}")
    return value


def check_float(value: Any, option: str, *, minimum: float = 0.0, maximum: float = math.inf,
                inclusive_min: bool = True) -> float:
    """``value`` as a finite float in ``[minimum, maximum]`` (or ``(minimum, maximum]``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive_min else value > minimum) and value <= maximum
    if not ok:
        low = "[" if inclusive_min else "("
        raise RecipeConfigError(option, f"must be a number in {low}{minimum}, {maximum}], got {value!r}")
    return float(value)


def check_choice(value: Any, option: str, choices: Iterable[str]) -> str:
    """``value`` as one of ``choices``."""
    allowed = list(choices)
    if value not in allowed:
        raise RecipeConfigError(option, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


def check_directory(value: Optional[str], option: str, *, hint: str = "") -> Optional[Path]:
    """``None`` (built-in data) or an existing directory, as a ``Path``."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value):
        raise RecipeConfigError(option, f"must be a directory path or null (built-in data), got {value!r}")
    path = Path(value).expanduser()
    if not path.exists():
        raise RecipeConfigError(option, f"directory {str(path)!r} does not exist{'; ' + hint if hint else ''} "
                                        "(leave it unset, null, to train on the built-in data)")
    if not path.is_dir():
        raise RecipeConfigError(option, f"{str(path)!r} is not a directory{'; ' + hint if hint else ''}")
    return path


def require_file(path: Path, option: str, what: str) -> Path:
    """``path`` if it is a file, else an error naming ``option`` and what was expected there."""
    if not path.is_file():
        raise RecipeConfigError(option, f"{what} not found: expected the file {str(path)!r}")
    return path
