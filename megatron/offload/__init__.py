"""Host memory tier: device layer, shared-memory parameter store, prefetch and offload."""

from megatron.offload.device import DeviceLayer, Event, get_device
from megatron.offload.grad_offload import (
    GradientOffloader,
    GradientsReady,
    default_grad_host_dtype,
)
from megatron.offload.host_memory import HostBufferPool
from megatron.offload.layout import (
    FlatLayout,
    bind_gradients,
    bind_parameters,
    copy_parameters_into,
)
from megatron.offload.naming import resolve_job_id
from megatron.offload.param_store import ParameterStore
from megatron.offload.prefetch import ParamSlots, Slot
from megatron.offload.shm import SegmentInUseError, SharedSegment
from megatron.offload.shm_space import ShmSpaceError

__all__ = [
    "DeviceLayer",
    "Event",
    "FlatLayout",
    "GradientOffloader",
    "GradientsReady",
    "HostBufferPool",
    "ParamSlots",
    "ParameterStore",
    "SegmentInUseError",
    "SharedSegment",
    "ShmSpaceError",
    "Slot",
    "bind_gradients",
    "bind_parameters",
    "copy_parameters_into",
    "default_grad_host_dtype",
    "get_device",
    "resolve_job_id",
]
