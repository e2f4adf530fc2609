"""The pre-auth fuzz target (tests/hostile/fuzz_preauth.py), briefly: seeded mutations
in this process, and coverage-guided inputs with atheris where it is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile.fuzz_preauth import run_mutations

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]


def test_seeded_mutations_of_the_pre_auth_path_raise_only_typed_errors() -> None:
    assert run_mutations(10_000, seed=5, report=lambda _: None) == 10_000


def test_coverage_guided_inputs_raise_only_typed_errors(tmp_path: Path) -> None:
    if importlib.util.find_spec("atheris") is None:
        import pytest  # noqa: PLC0415

        pytest.skip("atheris is not installed (pip install atheris)")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/hostile/fuzz_preauth.py"), "-runs=10000",
         "-max_total_time=60", f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 10000 runs" in done.stderr
