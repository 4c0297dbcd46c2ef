"""The README's main job (`make demo`) runs: its default budget must stay feasible as pricing changes
(it broke once, unnoticed, when the loss started being priced: GPT-2 small's floor rose to 0.64)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_the_demo_plans_within_its_budget_and_trains_exactly():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, os.path.join(root, "scripts", "demo.py")], cwd=root,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "within" in result.stdout and "OVER" not in result.stdout
    losses = [line.split()[1:3] for line in result.stdout.splitlines()
              if line.strip()[:1].isdigit() and len(line.split()) == 3]
    assert losses and all(original == optimized for original, optimized in losses)
