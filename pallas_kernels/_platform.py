"""Where kernels run: interpret on CPU, compile for the GPU; what the Hopper-only (Mosaic GPU) kernels need."""

import jax


def default_interpret(interpret: bool | None) -> bool:
    """`interpret` as given, else True unless the default backend is a GPU."""
    if interpret is not None:
        return interpret
    return jax.default_backend() != "gpu"


def on_hopper_compiled(interpret: bool | None) -> list[str]:
    """Why a Mosaic GPU kernel cannot run here (empty: it can): it is compiled for an sm_90 GPU, never
    interpreted."""
    reasons = []
    if default_interpret(interpret):
        reasons.append("Mosaic GPU kernels have no interpreter: they run compiled on an sm_90 GPU")
    device = jax.devices()[0]
    if device.platform != "gpu" or getattr(device, "compute_capability", None) != "9.0":
        reasons.append(f"it needs an sm_90 (Hopper) GPU, found {device.device_kind}")
    return reasons
