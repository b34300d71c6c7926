"""torch's Adafactor over sharded parameters: each parameter's update computed whole, each rank keeping its slice.

[Note: Adafactor over sharded matrices]
``torch.optim.Adafactor`` keeps, for a parameter of two or more dimensions, the running means of ``g**2`` over its
last dimension (``row_var``, shape ``(..., R, 1)``) and over the one before (``col_var``, ``(..., 1, C)``) in
place of Adam's per-element second moment; a vector keeps a per-element ``variance``. Its step scales the learning
rate by the parameter's RMS and divides the update by its own RMS beyond ``d``: norms over the whole parameter.
A flat piece is a vector to it, so stepped on pieces it would keep a full second moment and take both norms over
the piece, silently ([Note: optimizers that need whole parameters] in ``whole.py``).

Here, per chunk holding Adafactor's parameters, one all-gather of the values and gradients gives each rank those of
every parameter it holds a piece of, whole; torch's own ``adafactor`` function steps them, with the group's
``foreach`` as ``step()`` would; the rank keeps its slice of the values. The state is a whole parameter's, kept on
every rank that holds a piece, the same bits on each, updated there from the same whole gradient: ``row_var`` and
``col_var`` (``R + C`` numbers a matrix) and a vector's ``variance`` (norms' and biases' few elements). Checkpoints,
repacks and the plain format carry these keys whole beside ``step`` (``WholeStep.state_keys`` in ``whole.py``): a
``(R, 1)`` matrix's ``row_var`` has the parameter's own shape, so the key tells them from per-element state, not the
shape, and no matrix gets a ``variance`` of zeros. On one rank the pieces are the parameters and the step runs in
place. The result is torch's ``Adafactor.step`` on whole parameters, to the bit; a matrix's state costs ``R + C``
numbers, not Adam's ``2 R C``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim._adafactor import adafactor
from torch.optim.optimizer import _get_scalar_dtype

from .whole import WholeStep, gather_whole, own_slice

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk, TensorInfo


class AdafactorStep(WholeStep):
    """Adafactor's update of one optimizer's views ([Note: Adafactor over sharded matrices])."""

    optimizer_class = torch.optim.Adafactor
    state_keys = frozenset({"row_var", "col_var", "variance"})  # its factored and its vectors' second moments

    def step_chunk(self, chunk: Chunk, tensors: list[TensorInfo], views: dict[int, torch.Tensor]) -> None:
        mgr, opt = self.binding.manager, self.binding.optimizer
        alone = mgr.comm.world_size == 1  # the pieces are the parameters: stepped in place
        mine: dict[int, tuple[Any, torch.Tensor, dict[str, Any]]] = {}
        pieces = {}
        for t in tensors:
            v = views.get(t.slot.param_index)
            if v is not None and v.grad is not None:
                mine[t.slot.param_index] = (t, v, _state(opt.state[v], v.grad, t.shape))
                pieces[t.slot.param_index] = (t, [v, v.grad])
        # every rank gathers, with zeros where it holds nothing: the values and gradient of each parameter it
        # holds a piece of, whole
        whole = gather_whole(mgr, chunk, pieces, 2)
        for i, (t, v, st) in mine.items():
            g = opt.param_groups[self.group_of[i]]
            param, grad = (w.to(v.device) for w in whole[i])
            adafactor(
                [param],
                [grad],
                [st.get("row_var")],
                [st.get("col_var")],
                [st.get("variance")],
                [st["step"]],
                foreach=g["foreach"],
                d=g["d"],
                lr=g["lr"],
                beta2_decay=g["beta2_decay"],
                weight_decay=g["weight_decay"],
                eps1=g["eps"][0],
                eps2=g["eps"][1],
                maximize=g["maximize"],
            )
            if not alone:  # the whole values were scratch: keep this rank's slice
                v.copy_(own_slice(chunk, t, param))


def _state(st: dict[str, Any], grad: torch.Tensor, shape: torch.Size) -> dict[str, Any]:
    """A parameter's state as ``Adafactor._init_group`` makes it, for the whole parameter on the piece's device."""
    if not st:
        st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        if len(shape) > 1:
            st["row_var"] = grad.new_zeros((*shape[:-1], 1))
            st["col_var"] = grad.new_zeros((*shape[:-2], 1, shape[-1]))
        else:
            st["variance"] = grad.new_zeros(shape)
    return st
