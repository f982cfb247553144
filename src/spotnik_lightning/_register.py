"""Register ``strategy="spotnik"`` with Lightning without making ``import spotnik_lightning`` pay for
importing Lightning (about 2 s): at once if ``lightning.pytorch`` is already imported, otherwise
right after it is (a one-shot import hook). Ring-only processes never import Lightning."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_TARGET = "lightning.pytorch"


def register_strategy() -> None:
    """Add ``"spotnik"`` to Lightning's StrategyRegistry (idempotent)."""
    half = sys.modules.get("spotnik_lightning.lightning.strategy")
    if half is not None and not hasattr(half, "SpotnikStrategy"):
        return  # that module is importing Lightning right now; it registers itself once defined
    from lightning.pytorch.strategies import StrategyRegistry

    from spotnik_lightning.lightning.strategy import SpotnikStrategy

    if "spotnik" not in StrategyRegistry:
        SpotnikStrategy.register_strategies(StrategyRegistry)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        register_strategy()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # type: ignore[arg-type]
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now, or as soon as ``lightning.pytorch`` has been imported."""
    if _TARGET in sys.modules:
        register_strategy()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
