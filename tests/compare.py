"""How a test compares two trained models: parameter by parameter within a tolerance, or by the size of the
difference relative to the update the reference made."""

from __future__ import annotations

import torch

EXACT = dict(rtol=0, atol=0)


def assert_same_params(ref: torch.nn.Module, got: torch.nn.Module, tol: dict) -> None:
    """Every parameter of ``got`` equals ``ref``'s within ``tol`` (``torch.testing.assert_close``'s ``rtol`` and
    ``atol``), and none is NaN; the message names the first that differs."""
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert not b.isnan().any(), f"{n} is NaN"
        torch.testing.assert_close(b.cpu(), a.cpu(), msg=lambda m: f"{n}: {m}", **tol)


@torch.no_grad()
def relative_update_error(ref: torch.nn.Module, got: torch.nn.Module, init: torch.nn.Module) -> float:
    """|got - ref| / |ref - init| over all parameters: 0 for the same training, 1 for an error as large as the
    update itself. For comparisons where rounding differs by design (bf16 payloads against autocast)."""
    num = sum(
        (b.float().cpu() - a.float().cpu()).pow(2).sum()
        for a, b in zip(ref.parameters(), got.parameters(), strict=True)
    )
    den = sum(
        (a.float().cpu() - i.float().cpu()).pow(2).sum()
        for a, i in zip(ref.parameters(), init.parameters(), strict=True)
    )
    return float((num / den).sqrt())
