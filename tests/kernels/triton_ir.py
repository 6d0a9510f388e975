"""The Triton IR of Pallas kernels, lowered for an H200 on this CPU machine from abstract shapes (nothing is
allocated, so operands of any size lower) and verified; Triton's own passes and ptxas run only on a GPU."""

import jax
from jax._src.pallas.triton import gpu_info, pallas_call_registration


def triton_modules(monkeypatch, fn, *shapes) -> list[str]:
    """The Triton modules (text) of the kernels `fn` calls on arrays of `shapes`, in call order."""
    modules = []
    lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        assert result.module.operation.verify()
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module", keep)
    jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    return modules
