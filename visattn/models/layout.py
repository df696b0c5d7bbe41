"""The channels-last layout, and the one CPU convolution shape that must not run in it.

oneDNN (PyTorch's CPU convolution library; 3.12 in torch 2.14) has an open defect, **oneDNN issue 6035**:
"1x1 convolution backward_weights writes past the rtus workspace (nhwc, IC < ic_block)". A 1x1 convolution
with a stride above 1 and fewer input channels per group than the ISA's channel block (16 on AVX-512, 8 on
AVX2), given channels-last (nhwc) tensors on a CPU, corrupts the heap in its weight-gradient kernel: an abort
or ``double free or corruption`` on AVX-512, and on AVX2 weight gradients that are wrong in every element
without any crash. Its forward pass is correct, and every other shape, layout and device is unaffected.

:func:`to_channels_last` converts a model as ``model.to(memory_format=torch.channels_last)`` does and then,
on a CPU, runs each convolution of that shape (:func:`defective_convs`, the threshold 16 covering both ISAs)
in the contiguous layout: its weight is kept contiguous, its input made contiguous before it, the gradient of
its output made contiguous before its backward, and its output handed back channels-last, so the rest of the model keeps the layout asked for. Only those layers change;
a model with none of them (every recipe of this project) is converted exactly as before.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["ONEDNN_DEFECT", "defective_convs", "guard_onednn", "guard_message", "to_channels_last"]

ONEDNN_DEFECT = "oneDNN issue 6035"
IC_BLOCK = 16  # the widest ISA's input-channel block (AVX-512); AVX2's is 8
_GUARDED = "_visattn_contiguous_conv"


def _is_defective(conv: nn.Module) -> bool:
    return (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1) and max(conv.stride) > 1
            and conv.in_channels // conv.groups < IC_BLOCK)


def defective_convs(model: nn.Module) -> List[Tuple[str, nn.Conv2d]]:
    """The ``(name, conv)`` pairs of ``model`` that oneDNN's defect hits in channels-last on a CPU: 2-d, 1x1
    kernel, a stride above 1, fewer than 16 input channels per group."""
    return [(name, m) for name, m in model.named_modules() if _is_defective(m)]


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the contiguous layout's own strides. Not ``t.contiguous()``: a 1x1 kernel's channels-last
    weight, strides ``(C, 1, C, C)``, counts as contiguous and is handed back as it is, and oneDNN still reads
    its strides as channels-last."""
    canonical, step = [], 1
    for size in reversed(t.shape):
        canonical.insert(0, step)
        step *= size
    return t if list(t.stride()) == canonical else t.clone(memory_format=torch.contiguous_format)


def _contiguous_input(conv: nn.Conv2d, args: tuple) -> tuple:
    weight = conv.weight
    if _row_major(weight) is not weight:  # a later model.to(channels_last) undid it
        with torch.no_grad():
            conv.weight.data = _row_major(weight.data)
    x = args[0]
    return (_row_major(x),) + tuple(args[1:]) if isinstance(x, torch.Tensor) and x.dim() == 4 else args


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands the gradient on in the contiguous layout: the convolution's
    weight-gradient kernel then sees contiguous tensors only (its input, its weight and its output's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return _row_major(g)


def _channels_last_output(conv: nn.Conv2d, args: tuple, out: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return out
    return _ContiguousGrad.apply(out).contiguous(memory_format=torch.channels_last)


def guard_onednn(model: nn.Module) -> List[str]:
    """Run each of ``model``'s :func:`defective_convs` in the contiguous layout (weight, input; its output goes
    back to channels-last); returns their names. Idempotent; the parameters (and so the state dict, the
    optimizer and any checkpoint) are the same objects with the same values."""
    names = []
    for name, conv in defective_convs(model):
        names.append(name)
        if getattr(conv, _GUARDED, False):
            continue
        with torch.no_grad():
            conv.weight.data = _row_major(conv.weight.data)
        conv.register_forward_pre_hook(_contiguous_input)
        conv.register_forward_hook(_channels_last_output)
        setattr(conv, _GUARDED, True)
    return names


def _on_cpu(model: nn.Module, device: Optional[torch.device]) -> bool:
    if device is not None:
        return torch.device(device).type == "cpu"
    p = next(iter(model.parameters()), None)
    return p is None or p.device.type == "cpu"


def to_channels_last(model: nn.Module, device: Optional[torch.device] = None) -> List[str]:
    """``model.to(memory_format=torch.channels_last)``, except that on a CPU (``device``, else where the model's
    parameters are) the convolutions oneDNN's defect hits stay contiguous (:func:`guard_onednn`). Returns the
    names of the layers so kept (empty on a GPU, and for a model without such a layer)."""
    model.to(memory_format=torch.channels_last)
    if not _on_cpu(model, device) or not torch.backends.mkldnn.is_available():
        return []
    return guard_onednn(model)


def guard_message(names: Iterable[str], model: Optional[nn.Module] = None) -> str:
    """One line naming the layers :func:`to_channels_last` kept contiguous ('' for none)."""
    names = list(names)
    if not names:
        return ""
    modules = dict(model.named_modules()) if model is not None else {}
    first = modules.get(names[0])
    shape = (f" (1x1, stride {first.stride[0]}, {first.in_channels} input channels)"
             if isinstance(first, nn.Conv2d) else "")
    more = f" and {len(names) - 1} more like it" if len(names) > 1 else ""
    return (f"channels_last on CPU: conv {names[0]!r}{shape}{more} runs in the contiguous layout "
            f"({ONEDNN_DEFECT}: oneDNN's 1x1 strided weight gradient with under {IC_BLOCK} input channels "
            "corrupts memory in channels_last)")
