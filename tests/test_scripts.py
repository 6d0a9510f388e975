"""The GPU test scripts on a machine without a GPU: they refuse instead of passing with everything skipped, and
the mutations the GPU tests must catch still apply to the kernels' sources."""

import subprocess
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal without a GPU")


def run(*args):
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@no_gpu
def test_test_gpu_refuses_without_a_gpu():
    result = run("scripts/test_gpu.sh", "-q")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to run" in result.stderr


@no_gpu
def test_mutation_check_refuses_without_a_gpu():
    assert run("scripts/test_gpu_mutations.sh").returncode == 2


def test_every_mutation_still_applies():
    result = run("scripts/test_gpu_mutations.sh", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("applies: ") == 3
