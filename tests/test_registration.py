"""``strategy="spotnik"`` is registered whatever the import order, and ring-only processes never
import Lightning."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = "from lightning.pytorch.strategies import StrategyRegistry; assert 'spotnik' in StrategyRegistry"


@pytest.mark.parametrize("first", [
    "import spotnik_lightning; import lightning.pytorch",
    "import lightning.pytorch; import spotnik_lightning",
    "from spotnik_lightning.lightning.strategy import SpotnikStrategy",
    "import spotnik_lightning; spotnik_lightning.SpotnikStrategy",
])
def test_spotnik_strategy_is_registered_in_any_import_order(first: str) -> None:
    out = subprocess.run([sys.executable, "-c", f"{first}; {CHECK}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_importing_the_package_does_not_import_lightning() -> None:
    code = "import sys, spotnik_lightning, spotnik_lightning.ring; assert 'lightning.pytorch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
