"""benchmarks/run_benchmarks.py refuses mistaken options with one argparse error, before measuring anything."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_benchmarks.py"


@pytest.mark.parametrize("arguments, message", [
    (["--dtypes", "float33"], "--dtypes: float33 is not float32, bfloat16 or float16"),
    (["--prefill-limits", "mistral=abc"], "give MODEL=TOKENS pairs"),
    (["--models", "samba,gpt"], "unknown model 'gpt'"),
])
def test_mistaken_options_end_in_one_error(tmp_path, arguments, message):
    result = subprocess.run([sys.executable, str(SCRIPT), *arguments, "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written
