"""Tensor layout helpers shared by the kernels' launch functions."""

import torch


def platform(t: torch.Tensor) -> str:
    """Whose launch configurations a kernel takes for t: "cuda", "hip" (ROCm shows its GPUs as cuda devices) or
    "cpu" (Triton's interpreter, which wants few, large programs)."""
    if t.device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return t.device.type


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as a [rows, n_cols] matrix with unit column stride: a view when possible, else a contiguous copy."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()
