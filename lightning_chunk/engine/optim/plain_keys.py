"""Which parameter each entry of a plain optimizer ``state_dict`` belongs to.

[Note: optimizer state keyed by name]
``torch.optim`` keys its state by position (0, 1, ... through the param groups in order) and lists those positions
in each group's ``params``. FSDP's ``optim_state_dict``, ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` and so the checkpoints of Lightning's FSDP and ModelParallel strategies (a full-state
file, or a sharded directory after Lightning's ``consolidate_checkpoint``) key it by parameter name and list names
in ``params``. A run moving to ``chunk_offload`` from one of those resumes from that file, so both are read.
``torch.optim``'s own ``load_state_dict`` pairs either kind by position through ``params``. Names are matched here to
the parameters of those names instead: a checkpoint of another model is refused, naming what it lacks, where
pairing by position would load Adam's moments of one layer into another of the same count. Each group's names must
be that group's parameters, since the group's hyperparameters come with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..system.lazy_mapping import LazyMapping


def keyed_by_name(sd: dict[str, Any]) -> bool:
    """The state (or the groups' ``params``) names parameters rather than numbering them."""
    keys = [*sd["state"], *(k for g in sd["param_groups"] for k in g.get("params", ()))]
    return any(isinstance(k, str) and not k.isdigit() for k in keys)


def state_by_param(
    sd: dict[str, Any], group_params: Sequence[Sequence[int]], names: Sequence[str]
) -> Mapping[int, Any]:
    """Parameter index -> its entry of ``sd["state"]``, looked up when asked (a lazy ``state`` reads it only then:
    [Note: resuming a peer's sharded checkpoint] in ``state/peer_checkpoint.py``). ``group_params``: the parameter
    indices of each of this optimizer's param groups, in order; ``names``: each parameter index's name. Unknown keys
    are a clear error."""
    if keyed_by_name(sd):
        return LazyMapping(_by_name(sd, group_params, names), sd["state"].__getitem__)
    order = [i for g in group_params for i in g]
    keys: dict[int, Any] = {}
    for k in sd["state"]:
        pos = int(k)
        if pos >= len(order):
            raise ValueError(
                f"optimizer state names parameter position {pos}, but the optimizer has {len(order)} "
                "parameters: the checkpoint was written for another model or optimizer"
            )
        keys[order[pos]] = k
    return LazyMapping(keys, sd["state"].__getitem__)


def _by_name(sd: dict[str, Any], group_params: Sequence[Sequence[int]], names: Sequence[str]) -> dict[int, str]:
    index = {names[i]: i for g in group_params for i in g}
    group = {i: k for k, g in enumerate(group_params) for i in g}
    unknown = [str(n) for n in dict.fromkeys([*sd["state"], *(n for g in sd["param_groups"] for n in g["params"])])]
    unknown = [n for n in unknown if n not in index]
    if unknown:
        raise ValueError(
            f"the optimizer state names {len(unknown)} parameter(s) this optimizer does not hold: "
            f"{', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''} (it holds {', '.join(list(index)[:4])}"
            f"{', ...' if len(index) > 4 else ''}): the checkpoint was written for another model or optimizer"
        )
    for k, g in enumerate(sd["param_groups"]):
        moved = [n for n in g["params"] if group[index[n]] != k]
        if moved:
            raise ValueError(
                f"the optimizer state puts {moved[0]} in param group {k}; this optimizer has it in group "
                f"{group[index[moved[0]]]}: the groups are made otherwise than when the checkpoint was written"
            )
    return {index[n]: n for n in sd["state"]}
