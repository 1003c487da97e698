"""What the planner knows about a cluster: the GPU type and how nodes are connected.

Units everywhere: bytes, bytes/s, FLOP/s, seconds. Bandwidths are **per direction**:
``intra_node_bandwidth`` is what one GPU can send to its node's other GPUs, and
``inter_node_bandwidth`` is what one **node** can send to the other nodes (all its GPUs share it).
A network figure quoted in bits per second converts as ``gbps * 1e9 / 8`` bytes/s
(:func:`gbps_to_bytes`); NVLink totals in datasheets count both directions, so a preset's
``intra_node_bandwidth`` is half the datasheet figure.

Presets (:data:`GPU_PRESETS`, :func:`cluster_preset`) carry the published datasheet figures;
every field can be overridden (``cluster_preset("v100-32gb", 60, inter_node_bandwidth=gbps_to_bytes(35))``).
Figures that no datasheet gives (latencies, sustained host-memory bandwidth, reserved memory)
are stated assumptions: override them with measured values when you have them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from moetrain.comm.chunk_cost import EMULATED_GLOO_LINKS, Links  # noqa: F401  (re-exported)
from moetrain.validation import require_int, require_nonneg_float, require_positive_float

GiB = 2**30
PRECISIONS = ("fp32", "bf16", "fp16")


def gbps_to_bytes(gbps: float) -> float:
    """Network gigabits per second -> bytes per second: ``gbps * 1e9 / 8``."""
    return float(gbps) * 1e9 / 8


@dataclass(frozen=True)
class GPUSpec:
    """One GPU type.

    - ``memory_bytes``: device memory (bytes).
    - ``peak_flops``: dense peak FLOP/s per training precision (``"fp32"``, ``"bf16"``, ``"fp16"``);
      a precision the GPU has no fast path for is absent (V100: no bf16).
    - ``memory_bandwidth``: device memory bandwidth, bytes/s (the GPU optimizer step is bound by it).
    - ``pcie_bandwidth``: host <-> GPU bandwidth per direction, bytes/s (optimizer offload copies).
    """

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    pcie_bandwidth: float

    def __post_init__(self) -> None:
        require_int("gpu.memory_bytes", self.memory_bytes, 1)
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError(f"gpu.peak_flops must map precisions to FLOP/s, got {self.peak_flops!r}")
        for precision, flops in self.peak_flops.items():
            if precision not in PRECISIONS:
                raise ValueError(
                    f"gpu.peak_flops keys must be among {', '.join(map(repr, PRECISIONS))}, got {precision!r}"
                )
            require_positive_float(f"gpu.peak_flops[{precision!r}]", flops)
        require_positive_float("gpu.memory_bandwidth", self.memory_bandwidth)
        require_positive_float("gpu.pcie_bandwidth", self.pcie_bandwidth)

    def flops_for(self, precision: str) -> float:
        """Peak FLOP/s for ``precision``; ValueError naming the supported ones if absent."""
        if precision not in self.peak_flops:
            raise ValueError(
                f"precision {precision!r} has no fast path on {self.name}; supported: "
                f"{', '.join(map(repr, sorted(self.peak_flops)))}"
            )
        return self.peak_flops[precision]


# Datasheet figures. Sources:
# - V100: "NVIDIA Tesla V100 GPU Accelerator" datasheet (2018), SXM2 column: tensor performance
#   125 TFLOPS (fp16 inputs), single precision 15.7 TFLOPS, 32 GB HBM2 at 900 GB/s, NVLink 300 GB/s
#   (six links, both directions), PCIe Gen3 x16 (15.75 GB/s per direction). No bf16 support.
# - A100 80GB: "NVIDIA A100 Tensor Core GPU" datasheet (2021), SXM column: BF16/FP16 tensor
#   312 TFLOPS dense (624 with sparsity), FP32 19.5 TFLOPS, 80 GB HBM2e at 2,039 GB/s, NVLink
#   600 GB/s, PCIe Gen4 64 GB/s (both directions).
# - H100 80GB SXM: "NVIDIA H100 Tensor Core GPU" datasheet (2023), SXM column: BF16/FP16 tensor
#   1,979 TFLOPS with sparsity = 989 dense, FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink
#   900 GB/s, PCIe Gen5 128 GB/s (both directions).
# - P100 16GB: "NVIDIA Tesla P100" datasheet (2016), SXM2 (NVLink) column: half precision
#   21.2 TFLOPS, single 10.6 TFLOPS, 16 GB HBM2 at 732 GB/s, NVLink 160 GB/s, PCIe Gen3 x16.
# "fp32" is plain FP32 (PyTorch leaves TF32 matmuls off by default), not TF32. Memory sizes are
# binary (HBM stacks): a "32GB" V100 has 32 GiB, of which the driver shows ~31.75 GiB usable; plans
# keep ``PlanSettings.memory_headroom`` (default 10%) of ``memory_bytes`` free, which covers that.
GPU_PRESETS: dict[str, GPUSpec] = {
    "v100-32gb": GPUSpec(
        name="V100-SXM2-32GB",
        memory_bytes=32 * GiB,
        peak_flops={"fp16": 125e12, "fp32": 15.7e12},
        memory_bandwidth=900e9,
        pcie_bandwidth=15.75e9,
    ),
    "a100-80gb": GPUSpec(
        name="A100-SXM4-80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        memory_bandwidth=2039e9,
        pcie_bandwidth=32e9,
    ),
    "h100-80gb": GPUSpec(
        name="H100-SXM5-80GB",
        memory_bytes=80 * GiB,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        memory_bandwidth=3350e9,
        pcie_bandwidth=64e9,
    ),
    "p100-16gb": GPUSpec(
        name="P100-SXM2-16GB",
        memory_bytes=16 * GiB,
        peak_flops={"fp16": 21.2e12, "fp32": 10.6e12},
        memory_bandwidth=732e9,
        pcie_bandwidth=15.75e9,
    ),
}

# Node-level defaults per GPU preset (the matching DGX system unless stated):
# - NVLink per direction = datasheet total / 2.
# - inter-node: DGX-1 (V100, P100) 4x 100 Gb/s EDR InfiniBand; DGX A100 8x 200 Gb/s HDR;
#   DGX H100 8x 400 Gb/s NDR ("DGX-1", "DGX A100", "DGX H100" datasheets).
# - host memory: DGX-1 512 GiB, DGX A100 (80GB) 2 TiB, DGX H100 2 TiB (same datasheets).
# - sustained host-memory bandwidth (CPU Adam is bound by it) and latencies are assumptions:
#   about 2/3 of the sockets' DDR peak (DGX-1: 2x E5-2698v4, 4ch DDR4-2400 = 154 GB/s peak;
#   DGX A100: 2x EPYC 7742, 8ch DDR4-3200 = 410 GB/s; DGX H100: 2x Xeon 8480C, 8ch DDR5-4800 =
#   614 GB/s); message latency 10 us over NVLink, 20 us over InfiniBand (NCCL-level, incl. launch).
_NODE_DEFAULTS: dict[str, dict[str, float]] = {
    "v100-32gb": {
        "intra_node_bandwidth": 150e9,
        "inter_node_bandwidth": gbps_to_bytes(400),
        "host_memory_bytes": 512 * GiB,
        "host_memory_bandwidth": 100e9,
    },
    "p100-16gb": {
        "intra_node_bandwidth": 80e9,
        "inter_node_bandwidth": gbps_to_bytes(400),
        "host_memory_bytes": 512 * GiB,
        "host_memory_bandwidth": 100e9,
    },
    "a100-80gb": {
        "intra_node_bandwidth": 300e9,
        "inter_node_bandwidth": gbps_to_bytes(1600),
        "host_memory_bytes": 2048 * GiB,
        "host_memory_bandwidth": 270e9,
    },
    "h100-80gb": {
        "intra_node_bandwidth": 450e9,
        "inter_node_bandwidth": gbps_to_bytes(3200),
        "host_memory_bytes": 2048 * GiB,
        "host_memory_bandwidth": 400e9,
    },
}


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one type.

    - ``intra_node_bandwidth``: bytes/s one GPU sends to the others of its node (per direction).
    - ``inter_node_bandwidth``: bytes/s one node sends to other nodes (per direction, the node's
      NICs together; the node's GPUs share it when they all communicate at once).
    - ``intra_node_latency`` / ``inter_node_latency``: seconds per message (alpha).
    - ``host_memory_bytes``: host memory per node; ``host_reserved_bytes`` of it is taken by the
      OS, the data loader and the CUDA runtime (assumption, default 32 GiB).
    - ``host_memory_bandwidth``: sustained bytes/s of a node's CPU sockets (the CPU Adam step).
    - ``gpu_reserved_bytes``: per GPU, what the CUDA context, NCCL and cuBLAS workspaces and the
      allocator's fragmentation take besides the tensors; None (default): modelled per
      communicator and GPU type (:mod:`moetrain.planner.reserve`).
    """

    gpu: GPUSpec
    nodes: int
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 150e9
    inter_node_bandwidth: float = gbps_to_bytes(100)
    intra_node_latency: float = 10e-6
    inter_node_latency: float = 20e-6
    host_memory_bytes: int = 512 * GiB
    host_memory_bandwidth: float = 100e9
    host_reserved_bytes: int = 32 * GiB
    gpu_reserved_bytes: int | None = None
    name: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GPUSpec):
            raise ValueError(f"gpu must be a GPUSpec (see GPU_PRESETS), got {type(self.gpu).__name__}")
        require_int("nodes", self.nodes, 1)
        require_int("gpus_per_node", self.gpus_per_node, 1)
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "host_memory_bandwidth"):
            require_positive_float(name, getattr(self, name))
        for name in ("intra_node_latency", "inter_node_latency"):
            require_nonneg_float(name, getattr(self, name))
        require_int("host_memory_bytes", self.host_memory_bytes, 0)
        require_int("host_reserved_bytes", self.host_reserved_bytes, 0)
        require_int("gpu_reserved_bytes", self.gpu_reserved_bytes, 0, allow_none=True)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (
            f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.gpus_per_node} {self.gpu.name} "
            f"({self.world_size} GPUs, {self.inter_node_bandwidth * 8 / 1e9:g} Gb/s per node between nodes)"
        )

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gpu"}
        out["gpu"] = {f.name: getattr(self.gpu, f.name) for f in fields(self.gpu)}
        out["world_size"] = self.world_size
        return out


def cluster_preset(gpu: str, /, nodes: int, **overrides) -> ClusterSpec:
    """A cluster of ``nodes`` nodes of preset GPU type ``gpu`` (a key of :data:`GPU_PRESETS`,
    positional) with that system's node defaults; any :class:`ClusterSpec` field can be overridden,
    and GPU fields through ``gpu=replace(GPU_PRESETS[...], memory_bytes=...)``."""
    key = gpu.lower() if isinstance(gpu, str) else gpu
    if key not in GPU_PRESETS:
        raise ValueError(f"cluster must be one of {', '.join(map(repr, GPU_PRESETS))}, got {gpu!r}")
    known = {f.name for f in fields(ClusterSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown cluster field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    values = {"gpu": GPU_PRESETS[key], "nodes": nodes, "name": key, **_NODE_DEFAULTS[key]}
    values.update(overrides)
    return ClusterSpec(**values)


def with_overrides(cluster: ClusterSpec, **overrides) -> ClusterSpec:
    """``dataclasses.replace`` with the field names checked (ValueError naming the allowed ones)."""
    known = {f.name for f in fields(ClusterSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown cluster field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    return replace(cluster, **overrides)


# The M6-T cluster (V100-SXM2-32GB nodes of 8, 35 Gb/s between nodes) as the V100 preset has it, with
# the planner's default compute efficiency (0.4 of the fp16 peak): stated figures, not measured ones;
# configs/m6_1t.yaml gives them to its run as parallel.a2a_links.
M6T_V100_LINKS = Links(
    intra_node_latency=10e-6,
    inter_node_latency=20e-6,
    intra_node_bandwidth=_NODE_DEFAULTS["v100-32gb"]["intra_node_bandwidth"],
    inter_node_bandwidth=gbps_to_bytes(35),
    flops_per_s=0.4 * GPU_PRESETS["v100-32gb"].peak_flops["fp16"],
    gpus_per_node=8,
    source="cluster_preset('v100-32gb') with a 35 Gb/s node link, compute efficiency 0.4",
)
