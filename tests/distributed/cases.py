"""Which of a launch's cases the selected tests read, so that ``-k`` on one case launches that case alone.

A multi-rank launch runs many cases in one start of the ranks (each start costs about 10 s on two ranks). A test
names the cases it reads with ``@pytest.mark.cases(...)`` or by its ``case`` (and ``twin``) parameters; a fixture
that launches asks ``needed`` for the cases the session's selected tests read, in the launch's order. A selected
test that names none needs them all. A case this torch cannot run (``unavailable``) is launched by none and skipped
by the tests that read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_chunk.engine.system import torch_features


def cases_of(item: Any, marker: str) -> set[str] | None:
    """The cases ``item`` reads (its ``marker`` markers and its ``case``/``twin`` parameters), or ``None``."""
    found = {c for m in item.iter_markers(marker) for c in m.args}
    params = getattr(item, "callspec", None)
    if params is not None and marker == "cases":
        found |= {params.params[k] for k in ("case", "twin") if isinstance(params.params.get(k), str)}
    return found or None


def needed(request: Any, fixture: str, every: Sequence[str], marker: str = "cases") -> list[str]:
    """The cases of ``every`` that the session's selected tests using ``fixture`` read, in ``every``'s order."""
    wanted: set[str] = set()
    for item in request.session.items:
        if fixture not in getattr(item, "fixturenames", ()):
            continue
        got = cases_of(item, marker)
        if got is None:
            return [c for c in every if unavailable(c) is None]
        wanted |= got
    unknown = wanted - set(every)
    assert not unknown, f"tests read cases the {fixture} launch does not run: {sorted(unknown)}"
    return [c for c in every if c in wanted and unavailable(c) is None]


def unavailable(case: str) -> str | None:
    """Why the installed versions cannot run ``case``, or ``None`` ([Note: torch versions] in
    lightning_chunk/engine/system/torch_features.py): Muon's cases need torch 2.9, ``ema`` Lightning 2.6."""
    from lightning.pytorch import callbacks

    from tests.distributed.parity_cases import CASES

    if str(CASES.get(case, {}).get("cls", "")).startswith("Muon") and not torch_features.MUON:
        return "this torch has no torch.optim.Muon (torch 2.9)"
    if case == "ema" and not hasattr(callbacks, "EMAWeightAveraging"):
        return "this Lightning has no EMAWeightAveraging (Lightning 2.6)"
    return None
