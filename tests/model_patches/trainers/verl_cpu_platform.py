"""A CPU platform for verl's device layer, for tests only.

verl 0.9.1 registers NVIDIA, Ascend and ROCm platforms and falls back to NVIDIA on a CPU-only host,
so its weight-sync code calls `torch.cuda.synchronize()` and fails there. verl's own extension
points fix that without editing it: this module registers a "cpu" platform with
`PlatformRegistry`; a process loads it through `VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`
(imported by `import verl`) and selects it with `VERL_PLATFORM=cpu`. The platform says it has no
CUDA IPC, so verl's bucketed weight transfer takes its shared-memory transport (the one verl uses
on NPUs without IPC).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

# verl calls get_torch_device().synchronize()/.empty_cache()/.ipc_collect(); torch.cpu lacks the last two.
_CPU_MODULE = SimpleNamespace(
    synchronize=lambda *args, **kwargs: None,
    empty_cache=lambda: None,
    ipc_collect=lambda: None,
    is_available=lambda: True,
    current_device=lambda: 0,
    device_count=lambda: 1,
    set_device=lambda index: None,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPU_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # no CUDA IPC: verl's weight sync uses shared memory

    def cudart(self):
        return None
