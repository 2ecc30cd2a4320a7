"""Issue 26 item 4's probe: a KeyboardInterrupt at the first execution of every distinct line
of dlo's code that ``enable`` runs on the tiny demo pipeline (CI samples every 5th:
tests/cpu/test_interrupt_atomic.py); prints the points that leave something behind.

    PYTHONPATH=. python launch/interrupt_probe.py layer|module|layer-codec [STRIDE] [enable|disable]

2026-12-02 (CPU, torch 2.13): before dlo.journal.atomic layer 22 of 1160 points and module
21 of 639 broke; after it none of 1184 and 660 (about 3-7 min per mode on 2 cores).
"""

from __future__ import annotations

import os
import sys

from tests.cpu.test_interrupt_atomic import ROOT, probe

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "layer"
    stride = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    phase = sys.argv[3] if len(sys.argv) > 3 else "enable"
    tried, bad = probe(mode, stride=stride, phase=phase)
    print(f"{phase} {mode}: {len(bad)} bad of {tried}")
    for (path, lineno), why in bad.items():
        print(f"  {os.path.relpath(path, ROOT)}:{lineno}: {why}")
