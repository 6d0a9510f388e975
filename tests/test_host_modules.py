"""Host modules stay numpy-only: importing them must not import jax."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["dcp_jax.layout", "dcp_jax.page_allocator", "dcp_jax.config", "dcp_jax"])
def test_host_module_does_not_import_jax(module):
    code = f"import sys, {module}; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imports jax"
