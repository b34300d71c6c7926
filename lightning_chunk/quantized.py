"""bitsandbytes' 4-bit weights on the device as plain Lightning puts them there ([Note: quantized weights] in
``engine/config.py``).

[Note: quantizing where Lightning does]
A ``Params4bit`` made from float weights is quantized by its first ``.to(device)``: under plain Lightning, the
strategy's ``model.to(device)``, which also moves an already quantized weight's ``quant_state`` (its scales) to the
device. chunk_offload moves no parameter (the engine places them), so a QLoRA model built without ``.to`` failed in
bitsandbytes' forward on the float weights it still held, and one quantized on the host would have met device inputs
with host scales. ``quantize_for`` does what that ``.to`` does, a parameter at a time: an unquantized weight is
quantized on the device (in place: the same parameter object, as bitsandbytes' ``.to`` keeps it) and its codes go
back to the host, where the engine packs them; a quantized one's ``quant_state`` moves to the device. The device
thus holds one weight's codes at a time during set-up, and the scales for good (a 64th of the codes' elements in
fp32, less with nested statistics).

[Note: bitsandbytes' CPU layout]
On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit`` rewrites its weight's ``.data`` into another layout (another
shape) at its first forward without gradients in eval mode: an inference path, which a Hugging Face model trained
as ``from_pretrained`` left it (in eval mode: Lightning keeps each submodule's mode) takes. A chunk's parameter is a
view of its payload, gathered anew at each use, so the engine refused the write; the layout is turned off for the
layers it holds (``support_avx512bf16_for_cpu``), which then compute from the codes as in training mode: a rounding
apart from plain Lightning's run in eval mode there (2e-3 after four steps of a tiny Llama), its bits in training mode.
"""

from __future__ import annotations

import torch

from .engine.config import packed_codes

_HOST = torch.device("cpu")


def quantize_for(module: torch.nn.Module, device: torch.device) -> int:
    """Quantize ``module``'s unquantized 4-bit weights on ``device`` and move every ``quant_state`` there
    ([Note: quantizing where Lightning does]); returns how many weights it quantized."""
    quantized = 0
    for p in {id(p): p for p in module.parameters()}.values():
        if not packed_codes(p) or p.is_meta:
            continue
        if not getattr(p, "bnb_quantized", True):
            p.to(device)  # bitsandbytes' Params4bit.to: quantizes this parameter in place on the device
            quantized += 1
            if p.device != _HOST:
                p.data = p.data.to(_HOST)  # the codes, for the engine to pack; the scales stay on the device
        state = getattr(p, "quant_state", None)
        if state is not None:
            state.to(device)  # in place
    for m in module.modules():  # [Note: bitsandbytes' CPU layout]
        # not getattr: that computes a parametrized weight, and spectral norm's power iteration then moves on
        weight = m._parameters.get("weight")
        codes = weight is not None and packed_codes(weight)
        if codes and getattr(m, "support_avx512bf16_for_cpu", False):
            vars(m)["support_avx512bf16_for_cpu"] = False  # a plain attribute of bitsandbytes' layer
    return quantized
