"""The accelerator catalogue: what ``cluster.accelerator`` may name and what each kind can do.

The config checks ``cluster.accelerator`` against it and takes a device's memory as
the default ``cluster.device_memory``; the analytical cost model turns its
FLOP/s and bandwidth into layer times. Pure data, no project imports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator kind as the cost model sees it."""

    name: str
    peak_flops: float
    """Dense FLOP/s at the training dtype (bf16 on GPUs, fp32 on the CPU); no sparsity."""
    memory_bytes: int
    memory_bandwidth: float
    """Bytes/s of device memory."""
    efficiency: float = 0.45
    """Fraction of peak FLOP/s real kernels achieve."""
    bytes_per_param: int = 2
    """Bytes of a weight and an activation element at the compute dtype."""
    optimizer_bytes_per_param: int = 12
    """Adam state per parameter: fp32 master copy + two moments for mixed precision (12), two moments in fp32 (8)."""
    grad_bytes_per_param: int | None = None
    """Bytes of a gradient: the master dtype's (mixed precision accumulates into the masters); None:
    ``bytes_per_param``."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bandwidth", "bytes_per_param"):
            if not getattr(self, name) > 0:
                raise ValueError(f"device {self.name!r}: {name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.optimizer_bytes_per_param < 0:
            raise ValueError(
                f"device {self.name!r}: optimizer_bytes_per_param must be >= 0, got {self.optimizer_bytes_per_param}"
            )

    @property
    def grad_bytes(self) -> int:
        return self.grad_bytes_per_param if self.grad_bytes_per_param is not None else self.bytes_per_param

    def with_dtype(self, dtype: str, master_dtype: str | None = None) -> DeviceSpec:
        """The same device computing in ``dtype`` and training ``master_dtype`` masters (default: fp32
        for the half types, else ``dtype``): byte widths change, peak FLOP/s is kept.

        Mixed precision (the two differ) holds per parameter the compute copy, the master, its
        gradient in the master dtype and two Adam moments in the master dtype."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
        compute = DTYPE_BYTES[dtype][0]
        master = DTYPE_BYTES[master_dtype or ("float32" if compute == 2 else dtype)][0]
        optimizer = 2 * master + (master if master != compute else 0)
        return replace(self, bytes_per_param=compute, grad_bytes_per_param=master, optimizer_bytes_per_param=optimizer)


# dtype -> (bytes per weight/grad/activation, Adam bytes per parameter). Half types train
# with an fp32 master copy (4) + two fp32 moments (8); full types need only the moments.
DTYPE_BYTES = {"bfloat16": (2, 12), "float16": (2, 12), "float32": (4, 8), "float64": (8, 16)}

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # A desktop CPU core pool in fp32; what the tiny test models run on.
        DeviceSpec(name="cpu", peak_flops=1e11, memory_bytes=24 * GiB, memory_bandwidth=20e9,
                   efficiency=0.5, bytes_per_param=4, optimizer_bytes_per_param=8),
        # A40: 74.8 TFLOPS is its dense TF32 tensor peak (what the dissertation's runs used, §2.7.1);
        # its dense fp16/bf16 peak is 149.7 (299.4 with 2:4 sparsity). One peak per kind today, so
        # half-precision jobs on an A40 are priced at the TF32 rate. 48 GB GDDR6.
        DeviceSpec(name="a40", peak_flops=74.8e12, memory_bytes=48 * GiB, memory_bandwidth=696e9),
        DeviceSpec(name="a100-40gb", peak_flops=312e12, memory_bytes=40 * GiB, memory_bandwidth=1555e9),
        DeviceSpec(name="a100-80gb", peak_flops=312e12, memory_bytes=80 * GiB, memory_bandwidth=2039e9),
        # H100 SXM: 989 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s.
        DeviceSpec(name="h100", peak_flops=989e12, memory_bytes=80 * GiB, memory_bandwidth=3.35e12),
    )
}  # fmt: skip


def get_device(device: DeviceSpec | str) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[device]
