"""Registers the strategy names with Lightning without importing Lightning.

``import lightning_partial`` must not import Lightning (the engine,
:mod:`lightning_partial.collectives`, is plain torch.distributed), yet
``Trainer(strategy="eager_sgd")`` must work after it, whichever of
``import lightning`` and ``import lightning_partial`` comes first. So
:func:`install`, called by the package ``__init__``:

* if ``lightning.pytorch`` is imported already, registers at once
  (:func:`lightning_partial.strategies.register_strategies`);
* otherwise puts a :class:`_RegisterAfterImport` finder first on
  ``sys.meta_path``. It answers for ``lightning.pytorch`` alone: it asks the
  other finders for the module's spec, as the import system would, and wraps
  the spec's loader so that, right after ``lightning.pytorch`` has executed,
  the strategies register. Once the module has executed it removes itself
  from ``sys.meta_path`` and puts the module's own loader back, so the module
  looks as if imported normally (a spec lookup without an import, or an
  import that fails, leaves it in place for the next attempt).

Registration is idempotent (a name already in the registry is left alone) and
importing :mod:`lightning_partial.strategies` registers too, so any path that
reaches the strategy classes has them registered.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

_TARGET = "lightning.pytorch"
_lock = threading.Lock()


def _register() -> None:
    strategies = sys.modules.get("lightning_partial.strategies")
    if strategies is not None and not hasattr(strategies, "register_strategies"):
        # Lightning imported by lightning_partial.strategies itself (its first access):
        # that module registers at the end of its own import.
        return
    from lightning_partial.strategies import register_strategies

    register_strategies()


class _RegisteringLoader(importlib.abc.Loader):
    """``lightning.pytorch``'s own loader, plus registration once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, finder: "_RegisterAfterImport") -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            # The module's own loader back, as if imported without this finder.
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        _uninstall(self._finder)  # only now: the module has executed
        try:
            _register()
        except Exception as err:  # never break `import lightning` for the user: say what failed
            warnings.warn(
                f"lightning_partial could not register its strategies with Lightning ({err!r}); "
                "call lightning_partial.strategies.register_strategies() to see the error",
                RuntimeWarning,
                stacklevel=2,
            )

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` until ``lightning.pytorch`` is imported; see the module docstring."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _TARGET:
            return None
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader, self)
                return spec
        return None


def _uninstall(finder: _RegisterAfterImport) -> None:
    with _lock:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def _installed() -> bool:
    return any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path)


def install() -> None:
    """Registers now if ``lightning.pytorch`` is imported, else once it is (idempotent)."""
    if _TARGET in sys.modules:
        _register()
        return
    with _lock:
        if not _installed():
            sys.meta_path.insert(0, _RegisterAfterImport())
