"""Lightning callbacks the tests train with: they change what is trained mid-run (``requires_grad`` flipped, states
offloaded), or read and edit parameters and gradients between steps, as users' callbacks do."""

from __future__ import annotations

import contextlib

import lightning as L
import torch


class OffloadAndReload(L.Callback):
    """``offload_states()`` after the steps in ``offload_at`` and ``reload_states()`` before those in ``reload_at``
    (an offload with no reload is reloaded by the next step); ``seen`` keeps the device chunk bytes after each call."""

    def __init__(self, offload_at=(3, 9), reload_at=(6,)) -> None:
        self.offload_at, self.reload_at, self.seen = offload_at, reload_at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.offload_at:
            reducer = trainer.strategy.engine.manager.reducer  # the traced reduce schedule survives the round trip
            self.schedule = (list(reducer._order), reducer._due)
            trainer.strategy.offload_states()
            self.seen.append(("offloaded", trainer.strategy.memory_stats()["device_chunk_bytes"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.reload_at:
            trainer.strategy.reload_states()
            self.seen.append(("reloaded", trainer.strategy.memory_stats()["device_chunk_bytes"]))
            reducer = trainer.strategy.engine.manager.reducer
            assert (list(reducer._order), reducer._due) == self.schedule, "the reduce schedule was not kept"


class FlipRequiresGrad(L.Callback):
    """Progressive unfreezing and a re-freeze, set before every batch (so a resumed run sets them too): ``ParityNet``'s
    "frozen" variant trains blocks[0] from step ``unfreeze`` on, and freezes its embedding for steps
    ``unfreeze`` to ``refreeze``."""

    def __init__(self, unfreeze: int = 6, refreeze: int = 14) -> None:
        self.unfreeze, self.refreeze = unfreeze, refreeze

    def frozen(self, pl_module, step: int) -> list:
        """The parameters frozen at ``step``."""
        return ([*pl_module.blocks[0].parameters()] if step < self.unfreeze else []) + (
            [*pl_module.embed.parameters()] if self.unfreeze <= step < self.refreeze else []
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        frozen = {id(p) for p in self.frozen(pl_module, trainer.global_step)}
        for p in [*pl_module.blocks[0].parameters(), *pl_module.embed.parameters()]:
            p.requires_grad_(id(p) not in frozen)


class DropFrozenGrads(FlipRequiresGrad):
    """The same schedule for DDP, whose reducer only all-reduces the parameters that required grad when it was built:
    everything trains, and the gradients of the parameters the schedule freezes are dropped before each step (so the
    optimizer skips them, as it skips a frozen parameter)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in self.frozen(pl_module, trainer.global_step):
            p.grad = None


class ClampFirstBlock(L.Callback):
    """WGAN's weight clipping after every step, and a weight's norm read between steps: plain Lightning on the
    parameters, chunk_offload inside ``trainer.strategy.full_parameters()`` ([Note: parameters outside a step]).
    ``seen_outside``: what reading ``head.weight`` between steps, outside the block, gave: ``"value"``, ``"nan"``, or
    ``"refused"`` (a released parameter's read raises, [Note: released parameters read between steps]). ``write``:
    ``"in place"`` (``p.clamp_(...)``), ``"assign"`` (``p.data = p.data.clamp(...)``, as MoCo's momentum update writes)
    or ``"through .data"`` (``p.data.clamp_(...)``, WGAN's clipping as first published)."""

    def __init__(self, bound: float = 0.05, use_block: bool = True, write: str = "in place") -> None:
        self.bound, self.norms, self.use_block, self.write = bound, [], use_block, write
        self.seen_outside: list[str] = []
        self.seen_kept: list[str] = []  # the same read first, through a reference kept from before training

    def setup(self, trainer, pl_module, stage):
        self.kept = [pl_module.head.weight]

    @staticmethod
    def _read(weight: torch.Tensor, seen: list[str]) -> None:
        try:
            seen.append("nan" if torch.isnan(weight).all() else "value")
        except RuntimeError as e:
            assert "'head.weight' between steps" in str(e), e
            seen.append("refused")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import contextlib

        full = getattr(trainer.strategy, "full_parameters", None) if self.use_block else None
        self._read(self.kept[0], self.seen_kept)
        self._read(pl_module.head.weight, self.seen_outside)
        with full() if full else contextlib.nullcontext(), torch.no_grad():
            for p in pl_module.blocks[0].parameters():
                if self.write == "assign":
                    p.data = p.data.clamp(-self.bound, self.bound)
                elif self.write == "through .data":
                    p.data.clamp_(-self.bound, self.bound)
                else:
                    p.clamp_(-self.bound, self.bound)
            self.norms.append(float(pl_module.head.weight.norm()))
            self.saved = pl_module.blocks[0].state_dict()["0.weight"].clone()  # a whole value, clamped


class GradNormsAndEdits(L.Callback):
    """Lightning's ``grad_norm`` in ``on_before_optimizer_step`` (and the strategy's, from the shards), then the
    gradients edited: one block's halved in place, ``norm.bias``'s dropped every other step (so the step skips it).
    Plain Lightning on the parameters, chunk_offload inside ``full_parameters(with_grads=True)`` ([Note: gradients
    in full_parameters])."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []
        self.sharded: list[dict[str, float]] = []  # strategy.grad_norm (2 and inf) without gathering; DDP: Lightning's

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        import contextlib

        from lightning.pytorch.utilities import grad_norm

        full = getattr(trainer.strategy, "full_parameters", None)
        with full(with_grads=True) if full else contextlib.nullcontext():
            self.norms.append({k: float(v) for k, v in grad_norm(pl_module, norm_type=2).items()})
            blocks = pl_module.blocks if hasattr(pl_module, "blocks") else pl_module.blocks_reversed
            for p in blocks[1].parameters():
                if p.grad is not None:  # frozen (AdapterNet's blocks): none, as in plain Lightning
                    p.grad.mul_(0.5)
            if trainer.global_step % 2 == 0:
                pl_module.norm.bias.grad = None
        norms = getattr(trainer.strategy, "grad_norm", lambda p: grad_norm(pl_module, p))  # after the edits
        self.sharded.append({k: float(v) for p in (2, "inf") for k, v in norms(p).items()})


class GradsAfterBackward(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        with trainer.strategy.full_parameters(with_grads=True):
            pass


class StateDictOutside(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.state_dict()


class LoadsWeights(L.Callback):
    """``load_state_dict`` where users call it after set-up, each rank with the same values (drawn from a seed, one
    for each parameter, tied ones alike): the whole model in ``on_fit_start`` (pretrained weights), a submodule's keys
    only before step 3 (the first ``ModuleList``'s, at half the values, ``strict=False`` with a key missing) and, with
    ``at_end``, the whole model in ``on_train_end`` (restoring the best weights). Only parameter and buffer names and
    shapes are read from the module, as anything more between steps would need ``full_parameters()``."""

    def __init__(self, at_end: bool = False) -> None:
        self.at_end, self.state = at_end, {}

    def on_fit_start(self, trainer, pl_module):
        g = torch.Generator().manual_seed(11)
        drawn: dict[int, torch.Tensor] = {}
        for name, p in pl_module.named_parameters(remove_duplicate=False):
            if id(p) not in drawn:
                drawn[id(p)] = (0.1 * torch.randn(p.shape, generator=g)).to(p.dtype)
            self.state[name] = drawn[id(p)]
        self.state.update({n: b.detach().clone() for n, b in pl_module.named_buffers()})
        if trainer.ckpt_path is None:  # a resume: the checkpoint holds what training made of the loaded values
            pl_module.load_state_dict(self.state)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 3:
            name, sub = next((n, m) for n, m in pl_module.named_children() if isinstance(m, torch.nn.ModuleList))
            part = {k[len(name) + 1 :]: 0.5 * v for k, v in self.state.items() if k.startswith(name + ".")}
            dropped = next(k for k in part if k.endswith("bias"))
            del part[dropped]
            missing = sub.load_state_dict(part, strict=False).missing_keys
            assert missing == [dropped], missing

    def on_train_end(self, trainer, pl_module):
        if self.at_end:
            pl_module.load_state_dict(self.state)


class AddHeadGroup(L.Callback):
    """[Note: param groups added while training]: ``HeadAddedLater``'s head joins the optimizer as a param group of
    its own (a tenth of the learning rate, no weight decay) before step ``at``, unfrozen first where ``unfreeze``
    (a backbone unfrozen and added at once, as Lightning's finetuning callbacks do)."""

    def __init__(self, at: int = 3, unfreeze: bool = True) -> None:
        self.at, self.unfreeze = at, unfreeze

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and batch_idx % trainer.accumulate_grad_batches == 0:
            if self.unfreeze:
                pl_module.head.requires_grad_(True)
            opt = trainer.optimizers[0]
            opt.add_param_group({"params": [pl_module.head.weight], "lr": pl_module.lr / 10, "weight_decay": 0.0})


class AddHeadGroupAsDDP(AddHeadGroup):
    """The same for DDP, whose reducer only all-reduces the parameters that required grad when it was built: the head
    trains from the start, and its gradient is dropped before each step until it joins the optimizer."""

    def setup(self, trainer, pl_module, stage):
        pl_module.head.requires_grad_(True)  # before DDP wraps the module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        unfreeze, self.unfreeze = self.unfreeze, False
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.unfreeze = unfreeze

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step < self.at:
            pl_module.head.weight.grad = None


class LateGradientCopies(L.Callback):
    """Gradient copies to host shards land late, as on CUDA (``tests.late_copies``), from the first batch on;
    ``seen``: the threads that landed the copies after the warm-up step, and how many each."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.late = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        manager = trainer.strategy.engine.manager
        if self.late is None or manager.reducer.offload is not self.late:  # a resumed fit's engine is a new one
            from tests.late_copies import late_copies

            self.late = late_copies(manager)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > 1:  # after the warm-up step
            for e in self.late.events:
                self.seen[e.by] = self.seen.get(e.by, 0) + 1
        self.late.events.clear()
        self.late.handed.clear()


class DeviceBytesAtHandOvers(L.Callback):
    """[Note: the same device bytes on every rank in backward]: rank 1's worker takes 20 ms more a chunk, and
    ``seen["bytes"]`` is the device tier's bytes at each chunk handed to the worker, from the first batch on."""

    def __init__(self) -> None:
        self.seen: dict = {"bytes": []}
        self.early = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import time

        from lightning_chunk.engine.chunks.chunk import Tier

        early = trainer.strategy.engine.early
        if early is self.early:
            return
        self.early, ledger = early, trainer.strategy.engine.manager.ledger
        step, submit, slow = early._host_step, early.thread.submit, trainer.global_rank == 1

        def host_step(chunk):
            time.sleep(0.02 * slow)
            step(chunk)

        def handed_over(chunk, job, done):
            self.seen["bytes"].append(ledger[Tier.DEVICE])
            submit(chunk, job, done)

        early._host_step, early.thread.submit = host_step, handed_over


class CudaStreamsOnCpu(L.Callback):
    """[Note: streams and prefetch] with several ranks, played on a CPU device: the engine gets a stand-in copy
    stream, and while fitting ``torch.cuda``'s ``current_stream``, ``stream`` and ``Event`` are stand-ins that record
    on which stream each all-gather was issued (``seen["issued"]``: stream, asynchronous, count), every event
    recorded, and every event the compute stream waited on. Tensors still run on the CPU; only the stream calls are
    recorded."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self._saved: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._saved is None:
            self._install(trainer.strategy.engine.manager)

    def on_fit_end(self, trainer, pl_module):
        if self._saved is not None:
            for name, fn in self._saved.items():
                setattr(torch.cuda, name, fn)
            self._saved = None
        self.seen["waited"] = len(self.compute.waited)
        self.seen["waited_recorded_on"] = sorted({e.stream for e in self.compute.waited})
        self.seen["events"] = len(self.events)
        self.seen["side_waited_compute"] = self.side.waited_streams

    def _install(self, manager) -> None:
        import contextlib

        self.compute, self.side = _Stream("compute"), _Stream("side")
        self.current, self.events, issued = self.compute, [], {}
        self.seen["issued"] = issued
        cb = self

        class Event:
            def __init__(self) -> None:
                self.stream = None
                cb.events.append(self)

            def record(self, stream=None) -> None:
                self.stream = (stream or cb.current).name

        @contextlib.contextmanager
        def stream(s):
            before, cb.current = cb.current, s
            try:
                yield
            finally:
                cb.current = before

        self._saved = {n: getattr(torch.cuda, n) for n in ("current_stream", "stream", "Event")}
        torch.cuda.current_stream = lambda device=None: cb.current
        torch.cuda.stream, torch.cuda.Event = stream, Event
        manager._copy_stream = self.side
        gather = manager.comm.all_gather

        def all_gather(out, shard, **kw):
            key = f"{cb.current.name} async={bool(kw.get('async_op'))}"
            issued[key] = issued.get(key, 0) + 1
            return gather(out, shard, **kw)

        manager.comm.all_gather = all_gather


class _Stream:
    def __init__(self, name: str) -> None:
        self.name, self.waited, self.waited_streams = name, [], 0

    def wait_stream(self, other) -> None:
        self.waited_streams += other.name == "compute"

    def wait_event(self, event) -> None:
        self.waited.append(event)


class RecordsMoments(L.Callback):
    """Every moment of the fit, as ``[position, kind, module, evicted, fetched, resident, device bytes]``, in
    ``seen["moments"]``, and ``seen["backward_skips"]``: the backward plans [Note: backward moments with nothing to
    release] skipped. ``PlansEveryBackwardMoment`` is its twin with that rule off."""

    skips = True

    def __init__(self) -> None:
        self.seen: dict = {"moments": [], "backward_skips": 0}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        moments = trainer.strategy.engine.hooks.moments
        if moments.recorder is None:
            settled = type(moments)._backward_is_settled

            def counted(*args):
                skipped = self.skips and settled(moments, *args)
                self.seen["backward_skips"] += skipped
                return skipped

            moments._backward_is_settled = counted
            moments.recorder = self.record

    def record(self, e) -> None:
        row = [e.position, str(e.kind), e.module, e.evicted, e.fetched, e.resident, e.device_bytes]
        self.seen["moments"].append([list(v) if isinstance(v, tuple) else v for v in row])


class PlansEveryBackwardMoment(RecordsMoments):
    skips = False


WHOLE_STATES: dict[str, list] = {}  # the runner's process trains DDP first, then chunk_offload


class WholeOptimizerState(L.Callback):
    """Every parameter's whole optimizer state at the start of fit and after each micro-batch (DDP's
    ``optimizer.state``; chunk_offload's ``full_optimizer_state()``) and the norms of its moments
    (``optimizer_state_norms()``); after step ``RESET`` the head's moments zeroed and its count started again. Under
    chunk_offload ``seen`` is, per read, whether the state equals DDP's to the bit, whether it does to rounding (with
    sharded accumulation training is DDP's to rounding), whether the norms do, and whether there was any state (at
    the start: a resumed run's, read before the first step)."""

    RESET = 6

    def on_train_start(self, trainer, pl_module):
        self._read(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read(trainer, pl_module)
        if trainer.global_step == self.RESET:  # twice with accumulation, as on DDP: the second zeroes zeros
            full = getattr(trainer.strategy, "full_optimizer_state", None)
            opt = trainer.optimizers[0]
            plain = None if full else {p: opt.state[p] for p in pl_module.head.parameters()}
            with full(pl_module.head) if full else contextlib.nullcontext(plain) as state:
                for st in state.values():
                    for k in ("exp_avg", "exp_avg_sq", "step"):
                        st[k].zero_()

    def _read(self, trainer, pl_module):
        full = getattr(trainer.strategy, "full_optimizer_state", None)
        opt = trainer.optimizers[0]
        names = {p: n for n, p in pl_module.named_parameters()}
        plain = None if full else {p: opt.state.get(p, {}) for p in names}
        with full() if full else contextlib.nullcontext(plain) as state:
            now = {names[p]: {k: v.detach().clone() for k, v in st.items()} for p, st in state.items()}
        norms = (  # the moments a parameter has (max_exp_avg_sq in an amsgrad group)
            trainer.strategy.optimizer_state_norms()
            if full
            else {
                f"{k}_2.0_norm/{names[p]}": v.norm()
                for p, st in opt.state.items()
                for k, v in st.items()
                if k != "step"
            }
        )
        WHOLE_STATES.setdefault("chunk" if full else "ddp", []).append((now, norms))

    def on_train_end(self, trainer, pl_module):
        if hasattr(trainer.strategy, "full_optimizer_state"):
            ddp, chunk = WHOLE_STATES.pop("ddp"), WHOLE_STATES.pop("chunk")
            self.seen = [
                (_same_states(a, b, exact=True), _same_states(a, b), _close_norms(m, n), any(a.values()))
                for (a, m), (b, n) in zip(ddp, chunk, strict=True)
            ]


def _same_states(a: dict, b: dict, exact: bool = False) -> bool:
    """The same parameters, keys and values: to the bit, or to the rounding of sharded accumulation (relative to each
    element, and to the tensor's largest for the elements near zero)."""
    same = torch.equal if exact else lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-4 * float(x.abs().max()))
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(same(a[n][k], b[n][k]) for k in a[n]) for n in a
    )


def _close_norms(ddp: dict, chunk: dict) -> bool:
    """Each of DDP's per-parameter norms, to rounding (the root of a sum over the ranks' pieces)."""
    return all(k in chunk and torch.allclose(chunk[k], v, rtol=1e-5, atol=1e-12) for k, v in ddp.items())
