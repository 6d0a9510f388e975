"""The environment of a child process (a server, a deployment's process) that picks its own simulated devices."""

import os
import re

DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment and `extra`, XLA_FLAGS without its device count (its other flags, such as the
    compile level scripts/test.sh sets, stay)."""
    env = dict(os.environ, **extra)
    flags = DEVICE_COUNT_FLAG.sub("", env.pop("XLA_FLAGS", "")).split()
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env
