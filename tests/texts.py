"""A small training set from the text shipped with the demo (graphopt/data/demo.txt): its sentences as byte
sequences of varying length, and a collator that pads each batch to its own longest sequence."""

import re
from pathlib import Path

import torch

TEXT = Path(__file__).parents[1] / "graphopt" / "data" / "demo.txt"
VOCAB = 256  # bytes


def sentences(max_len: int = 160) -> list:
    """[{"input_ids": [byte, ...]}, ...], one per sentence of the text (lengths 9 to max_len)."""
    parts = (s.strip() for s in re.split(r"(?<=\.)\s", TEXT.read_text()))
    return [{"input_ids": list(s.encode())[:max_len]} for s in parts if len(s) > 8]


def pad_batch(rows: list, width: int | None = None) -> dict:
    """input_ids, attention_mask and labels padded to the batch's longest row (or to width, as a collator's
    pad_to_multiple_of pads batches to one length); padding is -100 in labels."""
    width = width or max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
