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


LIGHTNING_DEMO = DEMO.parent / "lightning_demo.py"


def test_lightning_demo_trains_through_a_kill_a_leave_and_a_join() -> None:
    out = subprocess.run([sys.executable, str(LIGHTNING_DEMO), "--epochs", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "replicas identical: True; survivors never restarted: True; w2 exit code 0" in out.stdout
    worlds = [int(m) for m in re.findall(r"from step +\d+ \(t= *[\d.]+ s\): (\d) members", out.stdout)]
    assert worlds[0] == 4 and 3 in worlds and 2 in worlds and worlds[-1] == 3, worlds
    assert re.search(r"j0: epoch \d+ -> adopted", out.stdout)
