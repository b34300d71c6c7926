"""The hybrid optimizer against torch.optim step by step, on both tiers."""

import pytest
import torch
import torch.nn as nn

from lightning_chunk.engine import ChunkConfig, ChunkEngine, UnsupportedOptimizerError


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))


def groups(model, **extra):
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, **extra}, {"params": rest, "weight_decay": 0.0}]


def run_steps(placement, make_opt, steps=6, unused_every=0, kernel="auto"):
    ref, m = net(), net()
    oref, o = make_opt(groups(ref)), make_opt(groups(m))
    eng = ChunkEngine(
        m, [o], config=ChunkConfig(placement=placement, chunk_numel=200, optimizer_kernel=kernel, check_invariants=True)
    )
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        skip_last = unused_every and step % unused_every == 1

        def fwd(model):
            h = model[3](model[2](model[1](model[0](x))))
            return h.sum() if skip_last else model[4](h).pow(2).mean()

        oref.zero_grad()
        fwd(ref).backward()
        oref.step()
        o.zero_grad()
        with eng.micro_batch(training=True):
            loss = fwd(m)
        loss.backward()
        eng.after_backward()
        eng.prepare_step()
        o.step()
        eng.finish_step(stepped=True)
        sd = eng.full_state_dict()
        for k, v in ref.state_dict().items():  # step by step, not only at the end
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=f"{placement} step {step} {k}")
    return eng, o, oref


@pytest.mark.parametrize("placement", ["device", "host", "static"])
@pytest.mark.parametrize("kernel", ["auto", "foreach", "loop"])
def test_adamw_matches_torch_on_both_tiers(placement, kernel):
    eng, o, _ = run_steps(placement, lambda g: torch.optim.AdamW(g, lr=0.05, betas=(0.8, 0.9)), kernel=kernel)
    tiers = {c.shard_tier.value for c in eng.manager.chunks}
    assert tiers == ({"device"} if placement == "device" else {"host"} if placement == "host" else {"host", "device"})
    if kernel == "auto":
        assert all(f["fused"] for f in eng.bindings[0].kernel_flags)  # the fused kernels step the shards
        assert all(g["fused"] is None for g in o.param_groups)  # and the user's groups keep their own flags


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
        lambda g: torch.optim.RMSprop(g, lr=0.01),
        lambda g: torch.optim.Adagrad(g, lr=0.1),
        lambda g: torch.optim.Adamax(g, lr=0.05),
        lambda g: torch.optim.NAdam(g, lr=0.05),
    ],
    ids=["sgd", "rmsprop", "adagrad", "adamax", "nadam"],
)
def test_other_elementwise_optimizers_match(make_opt):
    run_steps("host", make_opt)


def test_parameters_without_gradient_are_skipped_like_torch():
    eng, o, oref = run_steps("host", lambda g: torch.optim.AdamW(g, lr=0.05), steps=7, unused_every=2)
    last = eng.bindings[0].views()[eng.manager.index_of[id(eng.manager.params[-2])]]
    assert int(o.state[last]["step"]) == int(oref.state[list(oref.param_groups[0]["params"])[-1]]["step"]) < 7


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_shape_dependent_optimizers_are_refused(cls):
    m = net()
    with pytest.raises(UnsupportedOptimizerError, match=cls.__name__):
        ChunkEngine(m, [cls(m.parameters())])


def test_an_adafactor_not_torch_s_stays_refused_when_declared_elementwise():
    """Hugging Face's ``Adafactor`` factors by shape as torch's does, but only torch's is stepped whole; on the flat
    twins it looks element-wise within a group on one rank, so the word would let it keep a full second moment."""

    class Adafactor(torch.optim.SGD):  # the name is what is refused, as transformers.optimization.Adafactor
        pass

    m = net()
    config = ChunkConfig(assume_elementwise_optimizer=True)
    with pytest.raises(UnsupportedOptimizerError, match=r"Adafactor needs parameter shapes.*torch\.optim\.Adafactor"):
        ChunkEngine(m, [Adafactor(m.parameters(), lr=0.1)], config=config)


def test_unknown_optimizer_is_refused_unless_declared_elementwise():
    class MyAdam(torch.optim.Adam):
        pass

    m = net()
    with pytest.raises(UnsupportedOptimizerError, match="assume_elementwise_optimizer=True"):
        ChunkEngine(m, [MyAdam(m.parameters())])
    m2 = net()
    eng = ChunkEngine(m2, [MyAdam(m2.parameters())], config=ChunkConfig(assume_elementwise_optimizer=True))
    assert eng.bindings


def test_optimizer_state_round_trips_through_the_plain_format():
    eng, o, oref = run_steps("host", lambda g: torch.optim.AdamW(g, lr=0.05), steps=3)
    plain = eng.bindings[0].plain_state_dict()
    ref = oref.state_dict()
    assert plain["state"].keys() == ref["state"].keys()
    for k in ref["state"]:
        torch.testing.assert_close(plain["state"][k]["exp_avg"], ref["state"][k]["exp_avg"], rtol=1e-5, atol=1e-7)
    eng.bindings[0].load_plain_state_dict(ref)
    for k, v in enumerate(o.param_groups[0]["params"]):
        torch.testing.assert_close(o.state[v]["exp_avg_sq"], ref["state"][k]["exp_avg_sq"].reshape(-1))


def test_a_step_of_several_calls_leaves_the_groups_as_one_call_and_a_skipped_one_as_none():
    """[Note: group state in partial steps]: every call starts from the entries the step began with (a counter, a
    tensor changed in place, an entry a call adds), the last call's stay, and a step undone puts the first back."""
    from lightning_chunk.engine.optim.partial_steps import PartialSteps, only

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))], lr=0.1)
    g = opt.param_groups[0]
    g.update(k=0, total=torch.zeros(()))
    steps = PartialSteps(opt)

    def call(keep):
        with only(opt, keep, steps):
            g["k"] += 1
            g["total"].add_(1)
            g["added"] = len(g["params"])

    for keep in (lambda v: v is g["params"][0], lambda v: True, lambda v: False):
        call(keep)
    steps.ended()
    assert (g["k"], float(g["total"]), g["added"], len(g["params"])) == (1, 1.0, 0, 2)
    call(lambda v: True)
    call(lambda v: True)
    steps.undone()
    assert (g["k"], float(g["total"]), "lr" in g) == (1, 1.0, True)
    assert g["added"] == 0  # present when the step began, so kept as it was


def test_an_optimizer_taken_as_element_wise_is_refused_where_its_twins_show_it_would_compute_otherwise():
    """[Note: an optimizer said to be element-wise]: a trust ratio (LAMB) reads its parameter, refused on several
    ranks; a group norm (Prodigy) reads its group, refused wherever a group is stepped in several calls."""
    from lightning_chunk.engine.optim.elementwise import Dependence, dependence
    from lightning_chunk.engine.optim.kernels import check_optimizer
    from tests.optimizer_models import GroupCountedSGD, GroupNormalizedSGD, ScheduleFreeSGD, TrustRatioSGD

    def opt(cls):
        return cls(groups(net()))

    assert [dependence(opt(c)) for c in (TrustRatioSGD, GroupNormalizedSGD)] == [Dependence.WITHIN, Dependence.ACROSS]
    assert [dependence(opt(c)) for c in (ScheduleFreeSGD, GroupCountedSGD, torch.optim.SGD)] == [None] * 3
    taken = dict(assume_elementwise_optimizer=True, placement="host")
    check_optimizer(opt(TrustRatioSGD), ChunkConfig(**taken, step_in_backward=True))  # whole parameters on one rank
    with pytest.raises(UnsupportedOptimizerError, match=r"TrustRatioSGD.*within a parameter.*2 ranks each step"):
        check_optimizer(opt(TrustRatioSGD), ChunkConfig(**taken), world_size=2)
    check_optimizer(opt(GroupNormalizedSGD), ChunkConfig(**taken, step_in_backward=False))  # one call a group
    for config, why in (
        (dict(step_in_backward=True), "step_in_backward=True steps each chunk"),
        (dict(host_memory_limit="1GB", disk_dir="/tmp"), "may put chunks on the disk tier"),
    ):
        with pytest.raises(UnsupportedOptimizerError, match=rf"across the parameters of a group.*{why}"):
            check_optimizer(opt(GroupNormalizedSGD), ChunkConfig(**taken, **config))


def test_the_manual_window_leaves_torch_s_mode_stack_as_the_user_s_code_left_it():
    """[Note: a norm over the optimizer's gradient shards]: the window opens after a manual backward and closes at
    the step. A mode the user's code entered in between and has not left stays, and only the window's goes; blocks
    of the user's around the backward that ended before the step (each popped the top, ours first) leave the stack
    as they found it."""
    from torch.overrides import TorchFunctionMode

    from lightning_chunk.engine.optim.shard_norms import ManualWindow, ShardNorms, _stack

    window, user = ManualWindow(), TorchFunctionMode()
    window.open(list, world_size=1)  # one rank: nothing to watch
    assert window.mode is None and _stack() == []
    window.open(list, world_size=2)
    user.__enter__()
    assert [type(m) for m in _stack()] == [ShardNorms, TorchFunctionMode]
    window.close()
    assert _stack() == [user]
    user.__exit__(None, None, None)
    window.close()  # closed twice: nothing more
    assert _stack() == []
    for around in (1, 2):  # user blocks around the backward, left before the step
        kept, blocks = TorchFunctionMode(), [TorchFunctionMode() for _ in range(around)]
        kept.__enter__()
        for b in blocks:
            b.__enter__()
        window.open(list, world_size=2)
        for b in reversed(blocks):
            b.__exit__(None, None, None)
        window.close()
        assert _stack() == [kept], around
        kept.__exit__(None, None, None)
        assert _stack() == []


@pytest.mark.parametrize(
    "make, kw, nbytes",
    [
        (torch.optim.AdamW, dict(amsgrad=True), 12),  # AdamW's defaults hold an argument it refuses
        (torch.optim.AdamW, dict(), 8),
        (torch.optim.Adam, dict(amsgrad=True), 12),
        (torch.optim.SGD, dict(momentum=0.9), 4),
        (torch.optim.SGD, dict(), 0),
    ],
)
def test_the_state_an_element_is_what_the_optimizer_keeps_with_the_group_s_settings(make, kw, nbytes):
    """The device ledger and a disk shard's state file are sized from it before the first step."""
    from lightning_chunk.engine.optim.kernels import state_bytes_per_element

    opt = make([{"params": [nn.Parameter(torch.zeros(3))], **kw}, {"params": [nn.Parameter(torch.zeros(2))]}], lr=0.1)
    assert state_bytes_per_element(opt, opt.param_groups[0], torch.float32) == nbytes
    assert state_bytes_per_element(opt, opt.param_groups[0], torch.float64) == 2 * nbytes
