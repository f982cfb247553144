"""The README's main demo, end to end: four worker processes train, one is SIGKILLed, one joins;
the demo exits 0 only if the four final replicas are bit-identical and steps were redone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "ring_demo.py"


def test_ring_demo_survives_a_kill_and_a_join() -> None:
    out = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "replicas identical: yes" in out.stdout
    assert re.search(r"demo: SIGKILL w2", out.stdout)
    # the joiner received the state and finished with the others
    assert re.search(r"w4 synced", out.stdout) and re.search(r"'w4': '[0-9a-f]{12}'", out.stdout)
    redone = int(re.search(r"steps redone after the kill: (\d+)", out.stdout).group(1))
    assert redone >= 1
