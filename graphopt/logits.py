"""What the caller gets in place of logits graphopt did not compute (option keep_logits=False, the default)."""

import torch

KEEP_LOGITS_HINT = ("graphopt did not materialize the logits: the loss was computed from the hidden states chunk "
                    "by chunk (option keep_logits=False, the default in training). To read the logits, compile "
                    "with torch.compile(model, backend='graphopt', options={'keep_logits': True})")


class LogitsNotMaterializedError(RuntimeError):
    pass


class LogitsNotMaterialized(torch.Tensor):
    """A tensor with the logits' shape, dtype and device and no data: any operation on it raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise LogitsNotMaterializedError(f"{func}: {KEEP_LOGITS_HINT}")

    def __repr__(self):
        return f"LogitsNotMaterialized(shape={tuple(self.shape)}, dtype={self.dtype}) — {KEEP_LOGITS_HINT}"


def hand_back(compiled, positions):
    """compiled, with the outputs at positions (zero-cost stand-ins) replaced by LogitsNotMaterialized."""
    if not positions:
        return compiled

    def run(*args):  # Dynamo calls a backend's function with the inputs as arguments
        outputs = list(compiled(*args))
        for i in positions:
            outputs[i] = LogitsNotMaterialized(outputs[i])
        return outputs

    return run
