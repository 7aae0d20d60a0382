"""wandb_logger(): a Weights & Biases logger that is offline, silent and prompt-free by default.

``wandb`` is optional (the ``recipes`` extra) and is imported only when the
logger starts its run, never when this module is imported: machines without
``wandb`` (a GPU node, CI) can import everything in ``lightning_partial``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:  # only for annotations: importing it here would import wandb's integration eagerly
    from lightning.pytorch.loggers import WandbLogger

log = logging.getLogger(__name__)

INSTALL_HINT = 'wandb is not installed: pip install -e ".[recipes]" (or pip install wandb)'
_OFFLINE_MODES = ("offline", "dryrun")


def wandb_logger(
    *,
    project: str = "lightning_partial",
    save_dir: Union[str, Path] = "wandb",
    name: Optional[str] = None,
    offline: Optional[bool] = None,
    **kwargs: Any,
) -> "WandbLogger":
    """A Lightning ``WandbLogger`` that never prompts and, unless asked otherwise, never goes online.

    Args:
        project: the W&B project.
        save_dir: where the run directory goes (``<save_dir>/wandb/offline-run-*``);
            created if missing (W&B would otherwise fall back to a temporary directory).
        name: the run's display name.
        offline: ``True``: offline; ``False``: online (``WANDB_MODE`` may still say
            ``disabled``); ``None`` (default): offline unless the environment
            variable ``WANDB_MODE`` asks for another mode (e.g. ``online``).
        kwargs: passed on to ``WandbLogger`` (and from there to ``wandb.init``).

    Environment: sets ``WANDB_MODE=offline`` when offline and ``WANDB_SILENT=true``,
    each only if the user has not set it. Sync an offline run later with
    ``wandb sync <save_dir>/wandb/offline-run-*``.

    Raises:
        ImportError: ``wandb`` is not installed (with the install command).
        ValueError: a bad ``project``, ``name``, ``save_dir`` or ``offline``.
    """
    if not isinstance(project, str) or not project:
        raise ValueError(f"wandb_logger: project must be a non-empty string, got {project!r}")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"wandb_logger: name must be a string or None, got {name!r}")
    if not isinstance(save_dir, (str, Path)) or not str(save_dir):
        raise ValueError(f"wandb_logger: save_dir must be a non-empty path, got {save_dir!r}")
    if offline is not None and not isinstance(offline, bool):
        raise ValueError(f"wandb_logger: offline must be True, False or None, got {offline!r}")
    # find_spec, not import: wandb is imported by the logger when its run starts (rank 0 only).
    if importlib.util.find_spec("wandb") is None:
        raise ImportError(INSTALL_HINT)

    if offline is None:
        # There is no W&B server by default: offline unless the user chose a mode.
        offline = os.environ.get("WANDB_MODE", "offline") in _OFFLINE_MODES
    if offline:
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    path = Path(save_dir)
    path.mkdir(parents=True, exist_ok=True)
    log.info("W&B logger: project %r, %s, run directory under %s", project, "offline" if offline else "online", path)

    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project=project, save_dir=os.fspath(path), name=name, offline=offline, **kwargs)


__all__ = ["INSTALL_HINT", "wandb_logger"]
