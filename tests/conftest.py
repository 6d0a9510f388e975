"""Shared test set-up: 8 simulated CPU devices, highest matmul precision, a `gpu` marker, and the groups the
parallel runner (`scripts/test.sh`: pytest-xdist, --dist loadgroup) keeps on one worker: each test file (its
module fixtures are built once), and the files of one engine configuration together (`serving_utils.ENGINE_KW`:
the first compiles its programs into the session's persistent cache, the others read them). xdist reads the
groups into the test ids in its own pytest_collection_modifyitems, so ours runs first, and it writes them into
`item._nodeid`, which pytest 9 no longer reads (hence pytest < 9 in pyproject.toml)."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# No compilation cache in the home directory: a test that wants one names its directory.
os.environ.setdefault("DCP_JAX_DISABLE_COMPILE_CACHE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

ON_GPU = jax.default_backend() == "gpu"


# Test files that build an engine of `serving_utils.ENGINE_KW`.
SHARED_ENGINE_FILES = ("test_engine.py", "test_lm_eval.py", "test_load.py", "test_server.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        group = "shared_engine" if item.path.name in SHARED_ENGINE_FILES else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
