"""``OneProcessPerDevice``: the process plumbing of a Lightning strategy that runs one process a device, as DDP does:
devices and ranks, the launcher, the process group, and the collectives Lightning asks of a strategy. Nothing here
is particular to chunks; ``ChunkOffloadStrategy`` builds on it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities import imports as _lightning_imports
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor

from .ranks import barrier_device_ids, process_group_device, take_rank_threads


class OneProcessPerDevice(ParallelStrategy):
    """Devices, ranks, the process group and Lightning's collectives for one process a device."""

    def __init__(self, *, process_group_backend: str | None, timeout: timedelta | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    # ================================================================= ranks
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def local_rank(self) -> int:
        """0 where this is the only process ([Note: the launcher]), whatever ``LOCAL_RANK`` another ``Trainer``'s
        launcher set: its rank 1 runs the script again from the top, this fit included."""
        return super().local_rank if self.num_processes * self.num_nodes > 1 else 0

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _configure_launcher(self) -> None:
        """[Note: the launcher]
        One process in all (one device, one node) needs no launcher, as Lightning's single-device strategy has none:
        Lightning's script launcher refused a notebook ("not compatible with an interactive environment") even where
        it would start nothing, and left ``LOCAL_RANK`` and ``WORLD_SIZE`` in the environment, so a later
        ``Trainer(devices=2)`` in the same process took its ranks as started outside and waited for a rank 1 that
        never came. In a notebook (``python -i``, Jupyter) several devices are started by forking, as
        ``strategy="ddp_notebook"`` starts them (CUDA must not be initialised before ``fit``; Lightning checks); rank 0
        sends the trained weights and the metrics back to the notebook's process. Elsewhere the script launcher starts
        the script again for each device, as DDP's does ([Note: every rank's thread count] in ranks.py)."""
        assert self.cluster_environment is not None
        if self.num_processes * self.num_nodes == 1:
            self.cluster_environment.validate_settings(num_devices=1, num_nodes=1)  # torchrun's or SLURM's count
            self._launcher = None
        elif _lightning_imports._IS_INTERACTIVE:
            self._launcher = _MultiProcessingLauncher(self, start_method="fork")
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        if self.world_size > 1:
            reset_seed()
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            self._process_group_backend = backend
            assert self.cluster_environment is not None
            _init_dist_connection(
                self.cluster_environment,
                backend,
                timeout=self._timeout,
                device_id=process_group_device(self.root_device),
            )
        take_rank_threads()  # [Note: every rank's thread count] in ranks.py

    # ======================================================== collectives
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            ids = barrier_device_ids(self.root_device, torch.distributed.get_backend())
            if ids is not None:
                torch.distributed.barrier(device_ids=ids)
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
