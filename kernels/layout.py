"""Tensor layout helpers shared by the kernels' launch functions."""

import torch


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as a [rows, n_cols] matrix with unit column stride: a view when possible, else a contiguous copy."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()
