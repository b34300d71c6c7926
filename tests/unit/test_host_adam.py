"""Adam on host shards (``host_adam.py``): the one-pass step that also writes the compute-dtype copy, with the
moments in one flat region per chunk, against torch's own fused Adam, bit for bit.

Gradients are written straight into the gradient shards (no forward), so the reference, torch's optimizer
over plain tensors, steps on exactly the same numbers."""

import sys

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine, DtypePolicy
from lightning_chunk.engine.optim import adam_native, host_adam

# sizes: multiples of 16 (torch's fused kernel steps each tensor's last numel % 16 elements in a scalar loop of
# its own), and one that is not, where the one pass may differ in the last bit
SIZES = [(48, 32), (48,), (32, 48), (32,), (13,)]


def model():
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(*s) * 0.1) for s in SIZES)


def two_groups(params, cls, **kw):
    ps = list(params)
    return cls(
        [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}],
        **{"lr": 0.01, "betas": (0.9, 0.95), **kw},
    )


def run(kernel, *, cls=torch.optim.AdamW, dtypes=None, steps=3, reload_after=None, unused=(), **kw):
    """Step ChunkEngine (host tier) and torch's optimizer (fused, or the kernel ``kernel`` names) on the same
    gradients; returns both sides. ``unused``: (step, parameter) pairs that get no gradient."""
    ref, mine = model(), model()
    oref, o = (
        two_groups(ref, cls, **({"foreach": True} if kernel == "foreach" else {"fused": True}), **kw),
        two_groups(mine, cls, **kw),
    )
    eng = ChunkEngine(
        mine,
        [o],
        config=ChunkConfig(placement="host", chunk_numel=4096, optimizer_kernel=kernel),
        dtypes=dtypes or DtypePolicy(),
    )
    mgr = eng.manager
    fresh = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(*s, generator=g) * 0.01 for s in SIZES]
        for i, (p, gr) in enumerate(zip(ref, grads, strict=True)):
            p.grad = None if (step, i) in unused else gr.clone()
        oref.step()
        for i, gr in enumerate(grads):  # what a backward leaves in the gradient shards
            c, info = mgr.lookup(mgr.params[i])
            c.grad[info.offset : info.offset + info.numel].copy_(gr.reshape(-1))
            info.has_grad = (step, i) not in unused
        eng._backward_ends()
        eng.prepare_step()
        eng.step(o)
        fresh.append(set(eng.bindings[0].fresh_low))
        eng.finish_step(stepped=True)
        if reload_after == step:  # the state comes back in pieces, as from a checkpoint
            eng.bindings[0].load_plain_state_dict(eng.bindings[0].plain_state_dict())
    return eng, o, ref, oref, fresh


def check_against_torch(eng, o, ref, oref, exact_tail=True):
    mgr = eng.manager
    b = eng.bindings[0]
    for i, p in enumerate(ref):
        c, info = mgr.lookup(mgr.params[i])
        v = b.views()[i]
        st, st_ref = o.state[v], oref.state[p]
        pairs = [
            (c.master[info.offset : info.offset + info.numel], p.detach().reshape(-1), "param"),
            (st["exp_avg"], st_ref["exp_avg"].reshape(-1), "exp_avg"),
            (st["exp_avg_sq"], st_ref["exp_avg_sq"].reshape(-1), "exp_avg_sq"),
        ]
        if c.low is not None:
            pairs.append((c.low[info.offset : info.offset + info.numel], p.detach().reshape(-1).to(c.low.dtype), "low"))
        body = p.numel() - (0 if exact_tail else p.numel() % 16)
        for got, want, what in pairs:
            assert torch.equal(got[:body], want[:body]), f"parameter {i} {what} differs from torch's fused kernel"
            torch.testing.assert_close(got.float(), want.float(), msg=f"parameter {i} {what}")
        assert torch.equal(st["step"], st_ref["step"]) and st["step"].dtype == st_ref["step"].dtype
        assert set(st) == set(st_ref)


def regions_of(eng, o):
    """Per chunk, the storages of its views' moments (one per key when they live in flat regions)."""
    mgr = eng.manager
    out = {}
    for i, v in eng.bindings[0].views().items():
        c = mgr.lookup(mgr.params[i])[0]
        for key in ("exp_avg", "exp_avg_sq"):
            out.setdefault((c.chunk_id, key), set()).add(o.state[v][key].untyped_storage().data_ptr())
    return out


@pytest.mark.parametrize("kernel", ["one_pass", "foreach"])
def test_without_a_compute_copy_the_state_is_torchs_own(kernel):
    eng, o, ref, oref, fresh = run(kernel, reload_after=1)
    check_against_torch(eng, o, ref, oref)
    assert len(eng.manager.chunks) > 1
    assert not any(fresh)  # fp32: nothing for the one pass to do
    own = set().union(*(p for (_, key), p in regions_of(eng, o).items() if key == "exp_avg"))
    assert len(own) == len(SIZES)  # each parameter's moments a tensor of its own, as torch makes them


def count_native_calls(monkeypatch) -> list:
    """Calls of the native loop from here on (its kernel object wrapped)."""
    calls = []
    real = adam_native.native_kernel
    kernel = real()
    assert kernel is not None, adam_native.why_not()

    def counted(*args):
        calls.append(args[0].numel())
        return kernel(*args)

    counted.pack = kernel.pack
    monkeypatch.setattr(adam_native, "native_kernel", lambda: counted)
    return calls


@pytest.mark.parametrize("native", [True, False], ids=["native", "compiled"])
@pytest.mark.parametrize(
    "cls,low,kw",
    [
        (torch.optim.AdamW, torch.bfloat16, {}),
        (torch.optim.Adam, torch.float16, {"maximize": True}),
        # beta1 < 0.5: torch's lerp takes its other formula (weight 1 - beta1 >= 0.5)
        (torch.optim.AdamW, torch.bfloat16, {"betas": (0.3, 0.95)}),
    ],
)
def test_the_one_pass_steps_and_writes_the_compute_copy_as_torchs_fused_kernel(cls, low, kw, native, monkeypatch):
    """Both one-pass kernels: the native loop (``adam_native.py``, where it builds) and the ``torch.compile`` one."""
    monkeypatch.setattr(host_adam, "NATIVE", native)
    calls = count_native_calls(monkeypatch) if native else []
    eng, o, ref, oref, fresh = run("one_pass", cls=cls, dtypes=DtypePolicy(low, torch.float32), reload_after=1, **kw)
    check_against_torch(eng, o, ref, oref, exact_tail=False)
    assert all(f == {c.chunk_id for c in eng.manager.chunks} for f in fresh)  # every chunk, every step
    assert all(len(ptrs) == 1 for ptrs in regions_of(eng, o).values())
    assert len(calls) == (3 * len(eng.manager.chunks) if native else 0)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_the_native_loop_equals_torchs_fused_kernel_wherever_its_copy_starts(low):
    """The native loop streams the compute copy in aligned vectors and steps the elements before the first aligned
    one, and the last ``numel % width``, with masked vectors: the same bits wherever a shard starts in its copy.
    Torch's kernel steps the last ``numel % 16`` of a tensor in a scalar loop of its own: compared loosely there."""
    kernel = adam_native.native_kernel()
    assert kernel is not None, adam_native.why_not()
    for n, offset in [(1, 0), (15, 3), (16, 1), (100, 7), (4099, 0), (40_000, 5), (40_003, 13)]:
        g = torch.Generator().manual_seed(n + offset)
        p, grad = torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g) * 0.01
        ref = nn.Parameter(p.clone())
        opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        m, v, copy = torch.zeros(n), torch.zeros(n), torch.zeros(n + offset, dtype=low)
        for step in range(1, 4):
            ref.grad = grad * step
            opt.step()
            scalars = host_adam.adam_scalars(opt.param_groups[0], step, opt)
            kernel(p, grad * step, m, v, copy[offset:], *kernel.pack(scalars))
        body = n - n % 16
        for got, want in [
            (p, ref.detach()),
            (m, opt.state[ref]["exp_avg"]),
            (v, opt.state[ref]["exp_avg_sq"]),
            (copy[offset:], ref.detach().to(low)),
        ]:
            assert torch.equal(got[:body], want[:body]), (n, offset)
            torch.testing.assert_close(got.float(), want.float())
        assert torch.equal(copy[:offset], torch.zeros(offset, dtype=low))  # nothing written before the shard


def test_the_native_loop_reads_a_bf16_gradient_as_its_widening_to_fp32():
    """[Note: gradients in bf16 until the step]: the loop widens each bf16 gradient as it loads it, so the step is
    the one from the same values in fp32, bit for bit, in the vector body and in the masked head and tail, wherever
    the gradient and the copy start."""
    kernel = adam_native.native_kernel()
    assert kernel is not None, adam_native.why_not()
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for n, offset in [(1, 0), (15, 3), (16, 1), (100, 7), (40_003, 13)]:
        g = torch.Generator().manual_seed(n + offset)
        grad = torch.zeros(n + offset, dtype=torch.bfloat16)
        grad[offset:] = (torch.randn(n, generator=g) * 0.01).to(torch.bfloat16)
        start = (torch.randn(n, generator=g) * 0.1, torch.zeros(n), torch.zeros(n))
        out = []
        for gr in (grad[offset:].float(), grad[offset:]):
            p, m, v = (t.clone() for t in start)
            copy = torch.zeros(n + offset, dtype=torch.bfloat16)
            for step in range(1, 4):
                kernel(p, gr, m, v, copy[offset:], *kernel.pack(host_adam.adam_scalars(opt.param_groups[0], step, opt)))
            out.append((p, m, v, copy))
        assert all(torch.equal(a, b) for a, b in zip(*out, strict=True)), (n, offset)


def test_a_chunk_whose_views_leave_gaps_is_stepped_a_run_at_a_time(monkeypatch):
    """[Note: a chunk's views in several runs]: parameters of 13 and 7 elements leave padding before the next
    ([Note: aligned parameters]), so neither chunk's views tile one run, and torch's kernel stepped both in two
    passes (with fp32 gradients where bf16 ones would do). Each stretch of contiguous views is now a run of its own:
    every chunk is stepped by the one pass, as torch's fused kernel steps it, and takes bf16 gradients."""
    monkeypatch.setattr(sys.modules[__name__], "SIZES", [(13,), (48, 32), (32,), (7,), (32, 48)])
    calls = count_native_calls(monkeypatch)
    eng, o, ref, oref, fresh = run("one_pass", dtypes=DtypePolicy(torch.bfloat16, torch.float32))
    check_against_torch(eng, o, ref, oref, exact_tail=False)
    chunks = {c.chunk_id for c in eng.manager.chunks}
    assert len(chunks) == 2 and all(f == chunks for f in fresh)  # every chunk, every step
    assert len(calls) == 3 * 4  # two runs a chunk
    assert all(len(ptrs) == 2 for ptrs in regions_of(eng, o).values())  # a region per run
    b = eng.bindings[0]
    assert b.host_adam.low_grad_chunks(b.views()) == chunks


def test_a_chunk_with_a_parameter_that_got_no_gradient_is_left_to_torch():
    """Torch skips such a parameter (no state at first, its own ``step`` count after): its chunk cannot be
    stepped as one run, so torch's kernel steps it, and the other chunks still take the one pass."""
    eng, o, ref, oref, fresh = run(
        "one_pass", dtypes=DtypePolicy(torch.bfloat16, torch.float32), unused={(0, 1), (2, 1)}
    )
    check_against_torch(eng, o, ref, oref, exact_tail=False)
    mgr = eng.manager
    skipped = mgr.lookup(mgr.params[1])[0].chunk_id
    assert all(skipped not in f for f in fresh) and all(f for f in fresh)


def test_auto_keeps_two_passes_for_small_shards_and_falls_back_when_compiling_fails(monkeypatch):
    bf16 = DtypePolicy(torch.bfloat16, torch.float32)
    *_, fresh = run("auto", dtypes=bf16, steps=1)
    assert fresh == [set()]  # below ONE_PASS_MIN_NUMEL compiling would not pay

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler")

    # torch.compile switched off: the native loop does not need it
    monkeypatch.setattr(host_adam, "_broken", None)
    monkeypatch.setattr(host_adam, "_compiled", None)
    monkeypatch.setattr(host_adam, "_warned", False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torch.compile would run the function eagerly: not the kernel
    eng, o, ref, oref, fresh = run("one_pass", dtypes=bf16)
    check_against_torch(eng, o, ref, oref, exact_tail=False)
    assert all(fresh)
    # ... but without it, nothing else steps in one pass
    monkeypatch.setattr(host_adam, "NATIVE", False)
    monkeypatch.setattr(host_adam, "_broken", None)
    with pytest.raises(RuntimeError, match="optimizer_kernel='one_pass'.*torch.compile is disabled"):
        run("one_pass", dtypes=bf16, steps=1)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    monkeypatch.setattr(host_adam, "_broken", None)
    monkeypatch.setattr(host_adam, "one_pass_kernel", lambda: no_compiler)
    with pytest.raises(RuntimeError, match="optimizer_kernel='one_pass'.*no C\\+\\+ compiler"):
        run("one_pass", dtypes=bf16, steps=1)
    monkeypatch.setattr(host_adam, "ONE_PASS_MIN_NUMEL", 0)
    with pytest.warns(UserWarning, match="not available.*compiling it failed"):
        eng, o, ref, oref, fresh = run("auto", dtypes=bf16)
    check_against_torch(eng, o, ref, oref)  # torch's kernel and the two-pass write-back
    assert fresh == [set()] * 3


def test_auto_keeps_two_passes_where_inductor_has_no_vector_isa(monkeypatch):
    """Where inductor's probe for a vector ISA fails, every kernel it builds is scalar code (several times slower
    than torch's fused kernel): ``"auto"`` then keeps torch's kernel; ``"one_pass"`` still takes the one pass."""
    bf16 = DtypePolicy(torch.bfloat16, torch.float32)
    monkeypatch.setattr(host_adam, "ONE_PASS_MIN_NUMEL", 0)
    assert all(run("auto", dtypes=bf16, steps=1)[-1])
    monkeypatch.setattr(adam_native, "_isa", False)
    assert run("auto", dtypes=bf16, steps=1)[-1] == [set()]
    monkeypatch.setattr(adam_native, "_kernel", None)
    monkeypatch.setattr(adam_native, "_why_not", None)
    assert adam_native.native_kernel() is None and "no vector ISA" in adam_native.why_not()
    assert all(run("one_pass", dtypes=bf16, steps=1)[-1])  # the torch.compile kernel


def test_a_fit_on_a_gpu_builds_the_native_kernel_beside_set_up_and_the_step_waits_for_that_build(monkeypatch):
    """[Note: the kernel built beside set-up]: the first host step no longer builds the kernel itself (4 s a process
    with inductor's cache warm, 22 s cold), and a step that comes while the build runs takes that build's kernel."""
    import threading
    import types

    from lightning_chunk.engine.optim.kernels import kernel_flags

    native = adam_native
    builds, release = [], threading.Event()

    def build():
        builds.append(threading.current_thread().name)
        release.wait(10)
        return lambda *a: 8

    for name, value in (("_build", build), ("_kernel", None), ("_why_not", None), ("_building", False), ("_isa", True)):
        monkeypatch.setattr(native, name, value)
    model = torch.nn.Linear(4, 4)

    def manager(device: str, compute: torch.dtype | None):
        return types.SimpleNamespace(dtypes=DtypePolicy(compute_dtype=compute), device=torch.device(device))

    for device, compute, opt in (
        ("cpu", torch.bfloat16, torch.optim.Adam(model.parameters())),  # a CPU fit builds it at its first host step
        ("cuda", None, torch.optim.Adam(model.parameters())),  # no compute copy: no one pass
        ("cuda", torch.bfloat16, torch.optim.SGD(model.parameters(), lr=0.1)),  # not an Adam
    ):
        host_adam.HostAdam(opt, manager(device, compute), "auto", kernel_flags(opt, "auto"))
        assert not native._building, device
    adamw = torch.optim.AdamW(model.parameters())  # fused as the engine steps it, a user's default
    host_adam.HostAdam(adamw, manager("cuda", torch.bfloat16), "auto", kernel_flags(adamw, "auto"))
    for _ in range(1000):  # the background build under way
        if builds:
            break
        threading.Event().wait(0.01)
    got: list = []
    step = threading.Thread(target=lambda: got.append(native.native_kernel()))
    step.start()  # the first host step, while the build runs
    release.set()
    step.join(10)
    assert builds == ["lightning_chunk-native-adam"] and got == [native._kernel] and got[0] is not None
    native.build_in_background()  # built: nothing more
    assert len(builds) == 1
