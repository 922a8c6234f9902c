"""`pagedq bench chaos` for two minutes, a fault every 15 s (every kind at least once):
no job lost, duplicated or stuck, no 5xx but 503/504, every result the offline engine's.
Run as the CLI runs it, in a process of its own, about three minutes in all on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedq.chaos.faults import FAULT_KINDS
from tests.service_helpers import REPO

pytestmark = pytest.mark.slow


def test_a_two_minute_soak_under_faults_finds_no_violation(tiny_model_dir, tmp_path):
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "pagedq.cli", "bench", "chaos", "--model", str(tiny_model_dir()), "--minutes", "2",
               "--fault-every", "15", "--seed", "1", "--workdir", str(tmp_path), "--json", str(report_path)]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert report_path.exists(), finished.stdout[-3000:] + finished.stderr[-3000:]
    report = json.loads(report_path.read_text())

    assert set(report["faults"]["counts"]) == set(FAULT_KINDS)
    assert report["jobs"]["accepted"] > 100 and report["jobs"]["checked_against_offline"] > 100
    assert report["violations"] == [], finished.stdout[-6000:]
    assert finished.returncode == 0
