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
    """Dense FLOP/s at the half types' rate (bf16/fp16 tensor cores on GPUs; fp32 on the CPU); no
    sparsity. ``with_dtype`` swaps in ``float32_flops`` / ``float64_flops`` for the full types."""
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
    tf32_flops: float | None = None
    """Dense TF32 tensor-core FLOP/s, for ``dtype: float32`` with ``training.tf32``; None: ``float32_flops``."""
    float32_flops: float | None = None
    """Dense FP32 FLOP/s without TF32 (torch's default for matmuls: ``torch.backends.cuda.matmul.
    fp32_precision`` is ``ieee``), for ``dtype: float32``; None: ``peak_flops``."""
    float64_flops: float | None = None
    """Dense FP64 FLOP/s (tensor cores where the GPU has them), for ``dtype: float64``; None: ``peak_flops``."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bandwidth", "bytes_per_param"):
            if not getattr(self, name) > 0:
                raise ValueError(f"device {self.name!r}: {name} must be > 0, got {getattr(self, name)}")
        for name in ("tf32_flops", "float32_flops", "float64_flops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"device {self.name!r}: {name} must be > 0 or None, got {getattr(self, name)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.optimizer_bytes_per_param < 0:
            raise ValueError(
                f"device {self.name!r}: optimizer_bytes_per_param must be >= 0, got {self.optimizer_bytes_per_param}"
            )

    @property
    def grad_bytes(self) -> int:
        return self.grad_bytes_per_param if self.grad_bytes_per_param is not None else self.bytes_per_param

    def with_dtype(self, dtype: str, master_dtype: str | None = None, tf32: bool = False) -> DeviceSpec:
        """The same device computing in ``dtype`` and training ``master_dtype`` masters (default: fp32
        for the half types, else ``dtype``): byte widths change, and ``peak_flops`` becomes the
        dtype's rate (an A100 multiplies float32 at 19.5 TFLOP/s, in TF32 at 156, bf16 at 312).

        Mixed precision (the two differ) holds per parameter the compute copy, the master, its
        gradient in the master dtype and two Adam moments in the master dtype."""
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
        compute = DTYPE_BYTES[dtype][0]
        master = DTYPE_BYTES[master_dtype or ("float32" if compute == 2 else dtype)][0]
        optimizer = 2 * master + (master if master != compute else 0)
        float32 = (self.tf32_flops if tf32 else None) or self.float32_flops
        peak = {"float32": float32, "float64": self.float64_flops}.get(dtype) or self.peak_flops
        return replace(
            self,
            peak_flops=peak,
            bytes_per_param=compute,
            grad_bytes_per_param=master,
            optimizer_bytes_per_param=optimizer,
        )


# dtype -> (bytes per weight/grad/activation, Adam bytes per parameter). Half types train
# with an fp32 master copy (4) + two fp32 moments (8); full types need only the moments.
DTYPE_BYTES = {"bfloat16": (2, 12), "float16": (2, 12), "float32": (4, 8), "float64": (8, 16)}

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # A desktop CPU core pool in fp32, one rate for every dtype; what the tiny test models run on
        # (their plans are made from measured layer times where it matters).
        DeviceSpec(
            name="cpu",
            peak_flops=1e11,
            memory_bytes=24 * GiB,
            memory_bandwidth=20e9,
            efficiency=0.5,
            bytes_per_param=4,
            optimizer_bytes_per_param=8,
        ),
        # A40: dense bf16/fp16 149.7 TFLOPS (299.4 with 2:4 sparsity), TF32 74.8 (the dissertation's
        # runs, §2.7.1: its configs say dtype float32 with tf32), FP32 37.4, FP64 1/64 of it. 48 GB GDDR6.
        DeviceSpec(
            name="a40",
            peak_flops=149.7e12,
            memory_bytes=48 * GiB,
            memory_bandwidth=696e9,
            tf32_flops=74.8e12,
            float32_flops=37.4e12,
            float64_flops=0.585e12,
        ),
        # A100: dense bf16/fp16 312 TFLOPS, TF32 156, FP32 19.5, FP64 tensor cores 19.5.
        DeviceSpec(
            name="a100-40gb",
            peak_flops=312e12,
            memory_bytes=40 * GiB,
            memory_bandwidth=1555e9,
            tf32_flops=156e12,
            float32_flops=19.5e12,
            float64_flops=19.5e12,
        ),
        DeviceSpec(
            name="a100-80gb",
            peak_flops=312e12,
            memory_bytes=80 * GiB,
            memory_bandwidth=2039e9,
            tf32_flops=156e12,
            float32_flops=19.5e12,
            float64_flops=19.5e12,
        ),
        # H100 SXM: dense bf16/fp16 989 TFLOPS, TF32 494.7, FP32 67, FP64 tensor cores 67; 80 GB HBM3 at 3.35 TB/s.
        DeviceSpec(
            name="h100",
            peak_flops=989e12,
            memory_bytes=80 * GiB,
            memory_bandwidth=3.35e12,
            tf32_flops=494.7e12,
            float32_flops=67e12,
            float64_flops=67e12,
        ),
    )
}


def get_device(device: DeviceSpec | str) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[device]
