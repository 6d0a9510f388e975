"""Where kernels run: interpret on CPU, compile for the GPU."""

import jax


def default_interpret(interpret: bool | None) -> bool:
    """`interpret` as given, else True unless the default backend is a GPU."""
    if interpret is not None:
        return interpret
    return jax.default_backend() != "gpu"
