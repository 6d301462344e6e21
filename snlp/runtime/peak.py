"""The dense bf16 tensor-core peak of the card a run is on, for model FLOPs utilisation (MFU = achieved model
FLOP/s over this peak). Datasheet numbers without sparsity; a card not in the table has no known peak (None), and
so has a CPU: a CPU's peak depends on its ISA, clock and core count, which we do not guess."""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, dense bf16 TFLOP/s), first match wins: the specific names first
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H200 NVL", 836.0),  # the PCIe card's lower clocks (datasheet 1,671 TFLOP/s with sparsity)
    ("GH200", 989.0),  # before "H200", which its name contains
    ("H200", 989.0),  # SXM: the H100's compute with more memory
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),  # before "L4", which "NVIDIA L40" contains (datasheet 362 TFLOP/s with sparsity)
    ("A10G", 70.0),
    ("L4", 121.0),
)


def peak_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device by its name (None when the table does not know it)."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def peak_bf16_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of `device`: the table's entry for a CUDA card, None for a CPU or an unknown card."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))
