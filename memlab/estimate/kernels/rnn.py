"""``nn.LSTM`` out of training as cuDNN runs it on a GPU: one call that keeps no per-step state
(on ``meta`` it would run cell by cell and, with grad on, keep every step's gates)."""

from __future__ import annotations

from typing import Any

from memlab.core import _torch
from memlab.estimate.autocast import _region

_ORIGINAL_LSTM = _torch.VF.lstm


def _lstm(*args: Any, **kwargs: Any) -> Any:
    """``_VF.lstm`` (unpacked input) out of training, on ``meta``, as cuDNN runs it on a GPU."""
    if len(args) != 9 or kwargs or not isinstance(args[1], (tuple, list)):
        return _ORIGINAL_LSTM(*args, **kwargs)
    input, (h0, c0), weights, _, layers, p, train, bidirectional, batch_first = args
    if train or input.device.type != "meta" or _region() is not None:
        return _ORIGINAL_LSTM(*args, **kwargs)
    hidden = c0.shape[-1]
    proj = h0.shape[-1] if h0.shape[-1] != hidden else 0
    stride = len(weights) // (layers * (2 if bidirectional else 1))
    # cuDNN works sequence first: a batch-first input is copied to that layout, and the output
    # comes back as a transposed view of a sequence-first tensor (not contiguous)
    seq_first = input.transpose(0, 1).contiguous() if batch_first else input
    lstm_mode = 2  # cuDNN's mode number for an LSTM
    out = _torch.cudnn_rnn(
        seq_first,
        weights,
        stride,
        None,
        h0,
        c0,
        lstm_mode,
        hidden,
        proj,
        layers,
        False,
        p,
        False,
        bidirectional,
        [],
        None,
    )
    del seq_first
    output = out[0].transpose(0, 1) if batch_first else out[0]
    return output, out[1], out[2]
