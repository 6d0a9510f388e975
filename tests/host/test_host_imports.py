"""Host modules stay numpy-only: importing any module of dcp_jax/host/ (or another host module) must not import jax."""

import pathlib
import subprocess
import sys

import pytest

HOST_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dcp_jax" / "host"
HOST_MODULES = sorted(f"dcp_jax.host.{p.stem}" for p in HOST_PACKAGE.glob("*.py") if p.stem != "__init__")
OTHER_HOST_MODULES = ["dcp_jax", "dcp_jax.host", "dcp_jax.config", "dcp_jax.model.architecture",
                      "dcp_jax.serving.engine_args", "dcp_jax.serving.tokenizer", "dcp_jax.serving.protocol",
                      "dcp_jax.serving.metrics", "dcp_jax.serving.streams"]


def test_the_host_package_is_found():
    assert {"dcp_jax.host.layout", "dcp_jax.host.step_metadata", "dcp_jax.host.scheduler"} <= set(HOST_MODULES)


@pytest.mark.parametrize("module", HOST_MODULES + OTHER_HOST_MODULES)
def test_host_module_does_not_import_jax(module):
    code = f"import sys, {module}; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imports jax"
