import copy
import gc
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine, DeviceMemoryLimitError
from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.chunks.packing import build_layout
from lightning_chunk.engine.errors import ChunkError
from lightning_chunk.engine.runtime.description import plan_from_shapes
from lightning_chunk.engine.schedule.tracer import SavedBytesCounter
from tests.engine_steps import step


def test_engine_imports_no_lightning():
    code = (
        "import sys, lightning_chunk.engine as e; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]; "
        "print('BAD', bad); sys.exit(1 if bad else 0)"
    )
    # import the engine without the package __init__ (which registers the Lightning strategy)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util, sys, pathlib, types;"
            "root = pathlib.Path('lightning_chunk');"
            "pkg = types.ModuleType('lightning_chunk'); pkg.__path__ = [str(root)];"
            "sys.modules['lightning_chunk'] = pkg;" + code,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


class Reordered(nn.Module):
    """Registration order differs from use order: the warm-up must repack in first-use order."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(16, 4)
        self.first = nn.Linear(8, 16)
        self.middle = nn.Linear(16, 16)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def test_warmup_repacks_in_first_use_order_and_keeps_training_exact():
    torch.manual_seed(0)
    m, ref = Reordered(), Reordered()
    ref.load_state_dict(m.state_dict())
    opt, oref = torch.optim.Adam(m.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300, check_invariants=True))

    def names():
        return [t.name for c in eng.manager.chunks for t in c.tensors]

    assert names()[:2] == ["last.weight", "last.bias"]  # registration order before the trace
    steps_beside_plain(eng, m, opt, ref, oref, steps=4, width=8)
    assert names() == ["first.weight", "first.bias", "middle.weight", "middle.bias", "last.weight", "last.bias"]
    assert eng.warmed_up and eng.hooks.moments.trace is not None
    assert_as_plain(eng, ref)


def steps_beside_plain(eng, m, opt, ref, oref, *, steps: int, width: int) -> None:
    """``steps`` steps of the engine's model and of its plain twin on the same inputs."""
    for i in range(steps):
        x = torch.randn(3, width, generator=torch.Generator().manual_seed(i))
        step(eng, m, opt, x)
        oref.zero_grad()
        ref(x).pow(2).mean().backward()
        oref.step()


def assert_as_plain(eng, ref) -> None:
    sd = eng.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)


def test_saved_bytes_counter_counts_activations_once_and_releases_them():
    w = nn.Parameter(torch.randn(64, 64))
    counter = SavedBytesCounter(lambda t: False)
    x = torch.randn(32, 64, requires_grad=True)
    with counter.counting():
        h = torch.tanh(x @ w)  # saves x (and w, a parameter: not counted), and tanh's output
        y = (h * h).sum()  # saves h twice: one storage
    assert counter.live_bytes == 32 * 64 * 4 * 2
    y.backward()
    del h, y
    assert counter.live_bytes == 0


def test_saved_bytes_counter_lets_a_forward_without_backward_go():
    """[Note: a saved tensor held without its graph]: tanh saves its own output; the counter held it with its
    ``grad_fn``, a cycle no collection breaks, so a forward never followed by a backward stayed alive."""
    counter = SavedBytesCounter(lambda t: False)
    x = torch.randn(32, 64, requires_grad=True)
    with counter.counting():
        y = torch.tanh(x).sum()
    assert counter.live_bytes == 32 * 64 * 4
    del y
    gc.collect()
    assert counter.live_bytes == 0


def test_limit_too_small_for_the_traced_step_fails_before_the_first_step_with_numbers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="auto", chunk_numel=1056, device_memory_limit=8000))
    with eng.micro_batch(training=True):
        loss = m(torch.randn(64, 32)).sum()
    loss.backward()
    with pytest.raises(DeviceMemoryLimitError) as e:
        eng.prepare_step()
    msg = str(e.value)
    assert "device_memory_limit=8000 bytes (7.81 KiB) is too small" in msg  # MiB/GiB/KiB beside the bytes
    assert "4224 bytes (4.12 KiB) of chunks" in msg and "non-model memory" in msg and "smallest limit" in msg
    needed = int(msg.split("would work is ")[1].split(" bytes")[0])
    assert needed > 8000
    eng.teardown()
    for p, b in zip(m.parameters(), before, strict=True):  # no step was taken
        torch.testing.assert_close(p.detach(), b)


def test_static_placement_counts_its_device_shards_beside_the_traced_step():
    """[Note: the shards a placement keeps on the device]: a limit that held the traced step's chunks and
    activations passed, though ``static`` kept a third of the model's state on the device beside them; now it is
    refused after the warm-up with the limit that works, and that limit trains as the run without one."""
    torch.manual_seed(0)
    m = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
    x = torch.randn(64, 32)

    def run(limit):
        model = copy.deepcopy(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = ChunkConfig(placement="static", offload_fraction=0.6, chunk_numel=1056, device_memory_limit=limit)
        eng = ChunkEngine(model, [opt], config=config)
        for _ in range(3):
            step(eng, model, opt, x)
        eng.teardown()
        return model

    free = run(None)
    with pytest.raises(DeviceMemoryLimitError) as e:
        run(30000)  # the chunks and activations of the traced step alone fit
    msg = str(e.value)
    assert "8448 bytes (8.25 KiB) of shards placement='static' keeps on the device (1 of 3 chunks)" in msg
    assert "raise offload_fraction (static)" in msg
    needed = int(msg.split("would work is ")[1].split(" bytes")[0])
    assert needed > 30000
    for p, q in zip(run(needed).parameters(), free.parameters(), strict=True):
        assert torch.equal(p, q)


def test_limit_too_small_for_one_module_fails_at_construction():
    m = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(
        DeviceMemoryLimitError, match=r"one module needs 16640 bytes \(16.25 KiB\) of chunks.*or lower chunk_numel"
    ):
        ChunkEngine(
            m, [torch.optim.SGD(m.parameters(), lr=0.1)], config=ChunkConfig(device_memory_limit=1000, chunk_numel=4160)
        )
    # a user who left the chunk size to us is not told to lower it: it is as low as the largest parameter already
    with pytest.raises(DeviceMemoryLimitError) as e:
        ChunkEngine(m, [torch.optim.SGD(m.parameters(), lr=0.1)], config=ChunkConfig(device_memory_limit=1000))
    assert "lower chunk_numel" not in str(e.value) and "as small as the largest parameter" in str(e.value)


def test_parameter_identity_survives_the_whole_life():
    m = Reordered()
    ids = [id(p) for p in m.parameters()]
    opt = torch.optim.AdamW(m.parameters())
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300))
    for _i in range(2):
        step(eng, m, opt, torch.randn(2, 8))
        assert [id(p) for p in m.parameters()] == ids
    eng.teardown()
    assert [id(p) for p in m.parameters()] == ids
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in m.parameters())
    assert opt.param_groups[0]["params"][0] is next(m.parameters())  # the optimizer points back at them


def test_teardown_without_materializing_leaves_empty_parameters():
    m = Reordered()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300))
    step(eng, m, opt, torch.randn(2, 8))
    eng.teardown(materialize=False)
    assert all(p.numel() == 0 for p in m.parameters())
    assert eng.manager.chunks == [] and sum(eng.manager.ledger[t] for t in Tier) == 0


@pytest.mark.parametrize("failed", [False, True])
def test_after_a_failed_collective_teardown_frees_nothing_a_queued_collective_may_use(monkeypatch, failed):
    """[Note: memory a failed collective may still use]: gloo may still run a queued gather into a payload, or
    read a shard, after the engine's teardown; once a collective failed, teardown lets go of the buffers
    without freeing them, so one still held (as a gloo work holds its tensors) keeps its memory."""
    from lightning_chunk.engine.comm import waits

    m = Reordered()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host"))  # the automatic chunk size
    step(eng, m, opt, torch.randn(2, 8))
    # the shards, and the payloads gathered now (host placement released the others after the step)
    held = [
        t
        for c in eng.manager.chunks
        for t in (c.payload, c.master)
        if t is not None and t.untyped_storage().nbytes() > 0
    ]
    assert len(held) >= len(eng.manager.chunks)
    if failed:
        monkeypatch.setattr(waits, "_broken", ["a wait failed"])
    eng.teardown(materialize=False)
    assert all(p.numel() == 0 for p in m.parameters()) and eng.manager.chunks == []
    kept = [t.untyped_storage().nbytes() > 0 for t in held]
    del held  # out of the assertion's message: a freed tensor cannot be printed
    assert kept == [failed] * len(kept)


def test_global_grad_norm_is_reported_like_torch():
    torch.manual_seed(0)
    m, ref = Reordered(), Reordered()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300))
    x = torch.randn(4, 8)
    with eng.micro_batch(training=True):
        loss = m(x).pow(2).mean()
    loss.backward()
    eng.prepare_step()
    total = eng.clip_grad_norm_(0.01)
    ref(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert float(total) == float(expected) == eng.memory_stats()["grad_norm"]


def test_repack_streams_old_chunks_and_never_holds_the_model_twice(monkeypatch):
    """[Note: streaming repack]: an old chunk is read when the new layout first needs it and its host
    copy goes once its parameters are placed, so the unsharded copy never holds the whole model."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])  # 272 elements a layer
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300, check_invariants=True))
    mgr = eng.manager
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    held: list[int] = []
    import lightning_chunk.engine.memory.manager as manager_mod

    build = manager_mod.build_chunk

    def counting_build(mgr_, spec, tier, source, **kw):
        chunk = build(mgr_, spec, tier, source, **kw)
        held.append(len(source._values))  # unsharded copies alive now
        return chunk

    monkeypatch.setattr(manager_mod, "build_chunk", counting_build)
    layout = build_layout(mgr.specs, list(range(len(mgr.params))), 600, world_size=1)  # two layers a chunk
    mgr.pack(layout, {c.chunk_id: Tier.HOST for c in layout.chunks})
    assert len(held) == 4 and max(held) <= 4  # one new chunk's parameters (4), never all 16
    for k, v in eng.full_state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_tracer_charges_the_peak_between_moments_to_the_module_that_ran():
    """[Note: peaks between moments]: what a module holds only while it runs belongs to the moment before it."""
    from lightning_chunk.engine.schedule.tracer import FORWARD, POST_FORWARD, MemoryTracer

    tracer = MemoryTracer(lambda t: False, torch.device("cpu"), lambda: 0)
    peaks = iter([0, 0, 5000, 0, 0])  # the allocator's peak read at start, at each moment, at finish
    tracer._peak_since_last_moment = lambda: next(peaks)
    tracer.start()
    tracer.record(FORWARD, "a", (0,), (0,))
    tracer.record(POST_FORWARD, "a", (), ())  # module a peaked at 5000 bytes while it ran
    tracer.record(FORWARD, "b", (1,), (1,))
    trace = tracer.finish()
    assert [m.nonmodel_bytes for m in trace.moments] == [5000, 0, 0]
    assert trace.nonmodel_peak_bytes == 5000


def test_warmup_reduce_order_follows_reverse_first_use():
    from lightning_chunk.engine.schedule.tracer import BACKWARD, FORWARD, MemoryTracer

    tracer = MemoryTracer(lambda t: False, torch.device("cpu"), lambda: 0)
    tracer.start()
    for kind, chunks in [(FORWARD, (2,)), (FORWARD, (0, 2)), (FORWARD, (1,)), (BACKWARD, (3,))]:
        tracer.record(kind, "m", chunks, ())
    assert tracer.forward_first_use() == [2, 0, 1]


def test_zero_grad_set_to_none_false_zeroes_through_the_views():
    """zero_grad(set_to_none=False) zeroes gradients in place: the next backward adds to zeros, as in torch."""
    torch.manual_seed(0)
    m, ref = Reordered(), Reordered()
    ref.load_state_dict(m.state_dict())
    opt, oref = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host", chunk_numel=300))
    for i in range(3):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        opt.zero_grad(set_to_none=False)
        oref.zero_grad(set_to_none=False)
        with eng.micro_batch(training=True):
            loss = m(x).pow(2).mean()
        loss.backward()
        eng.prepare_step()
        opt.step()
        eng.finish_step(stepped=True)
        ref(x).pow(2).mean().backward()
        oref.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(eng.full_state_dict()[k], v, rtol=1e-6, atol=1e-7)


class RootOwned(nn.Module):
    """The root holds a parameter directly and uses it last, after submodules registered in another order than
    they run: its gradient arrives through the hook ``step_scope`` puts on the step's outputs."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.body = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.head(torch.relu(self.body(x))) * self.scale


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_parameters_the_root_owns_train_like_torch(step_in_backward):
    torch.manual_seed(0)
    m, ref = RootOwned(), RootOwned()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.AdamW(m.parameters(), lr=0.05, fused=True)
    oref = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    eng = ChunkEngine(
        m, [opt], config=ChunkConfig(placement="host", step_in_backward=step_in_backward, check_invariants=True)
    )  # the automatic chunk size
    for i in range(4):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
        step(eng, m, opt, x)
        oref.zero_grad()
        ref(x).float().pow(2).mean().backward()
        oref.step()
    sd = eng.full_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert not torch.equal(sd["scale"], torch.linspace(0.5, 1.5, 4))  # the root's own parameter trained


def test_a_root_that_owns_parameters_needs_the_step_outputs_registered():
    """Without ``outputs(loss)`` backward would read the root's released payload (host placement releases it after
    forward): a segmentation fault. The step says what to do instead, before any backward."""
    m = RootOwned()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    eng = ChunkEngine(m, [opt], config=ChunkConfig(placement="host"))
    with pytest.raises(ChunkError, match=r"owns parameters directly \(scale\).*outputs\(loss\)"):
        with eng.micro_batch(training=True):
            m(torch.randn(3, 8)).pow(2).mean()
    with torch.no_grad(), eng.micro_batch(training=False):  # evaluation has no backward: nothing to register
        m(torch.randn(3, 8))


def test_the_first_layout_is_sized_with_each_module_s_chunks():
    """The automatic chunk size of the first layout is chosen before the hooks go in; it must still see which
    chunks each module uses (before, it saw none: a busiest module of two chunks plus a gradient payload was
    counted as the gradient payload alone, and a limit that layout did not fit was accepted, then failed)."""
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(net.parameters())
    plan = plan_from_shapes(
        net, [opt], config=ChunkConfig(device_memory_limit=10 * 2**20, chunk_numel_min=4096), world_size=2
    )
    payload = {v.chunk_id: v.payload_bytes for v in plan.views}
    slot_of = plan.layout.slot_of()
    weight_chunk = slot_of[0].chunk_id  # the first linear's weight
    chunks_of_first = {slot_of[i].chunk_id for i in (0, 1)}
    grad = max(v.grad_payload_bytes for v in plan.views)
    assert plan.need_before_activations >= sum(payload[c] for c in chunks_of_first) + grad > grad
    assert payload[weight_chunk] > 0


@pytest.mark.parametrize("limit_mib", [3, 4, 6])
def test_the_warm_up_layout_of_several_ranks_leaves_room_for_a_second_gradient_payload(limit_mib):
    """Registration order: in the warm-up's backward a chunk whose gradients wait for the rest of its tensors keeps
    its gradient payload while the next chunk fills one, so the automatic size leaves room for both (on 2 ranks,
    bf16-mixed and a limit of 0.3x the parameter bytes failed the first backward without it)."""
    net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 1024))
    limit = limit_mib * 2**20
    plan = plan_from_shapes(
        net,
        [torch.optim.AdamW(net.parameters())],
        world_size=2,
        config=ChunkConfig(device_memory_limit=limit, chunk_numel_min=4096),
    )
    grad = max(v.grad_payload_bytes for v in plan.views)
    largest = 1024 * 256
    # room for both, unless the chunks are already as small as the largest parameter (3 MiB: 263,168 elements before)
    assert plan.layout.capacity_numel <= largest or plan.need_before_activations + grad <= limit, (
        plan.layout.capacity_numel,
        plan.need_before_activations,
        grad,
        limit,
    )
