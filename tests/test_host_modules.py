"""Host modules stay numpy-only: importing them must not import jax."""

import subprocess
import sys

import pytest


HOST_MODULES = ["dcp_jax", "dcp_jax.config", "dcp_jax.layout", "dcp_jax.page_allocator", "dcp_jax.scheduler",
                "dcp_jax.sampling", "dcp_jax.tokenizer", "dcp_jax.protocol", "dcp_jax.metrics"]


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_module_does_not_import_jax(module):
    code = f"import sys, {module}; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imports jax"
