"""What a user does beyond a plain fit, on two ranks against DDP: checkpoints saved during and after fit and
resumed, a state_dict the LightningModule edits, a sharded EMA, parameters frozen and read outside a step, a
gradient penalty, BatchNorm, weights loaded from files, states offloaded between phases.
"""

import json

import pytest
import torch

from tests.distributed.launch import ROUNDING, check_parity, stats
from tests.models import quiet_trainer
from tests.weights_files import FORMATS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # several ranks; a launch of many cases


@pytest.mark.cases("offload_states")
def test_offloaded_states_leave_no_device_bytes_on_either_rank(parity_run):
    """[Note: offloading states between phases]: the parity with DDP is test_parity_with_ddp[offload_states]."""
    out, rc, log = parity_run
    for s in stats(out, "offload_states"):
        (seen,) = s["seen"]
        assert [what for what, _ in seen] == ["offloaded", "reloaded", "offloaded"]
        assert [b for what, b in seen if what == "offloaded"] == [0, 0] and dict(seen)["reloaded"] > 0


@pytest.mark.cases("save_after_fit")
def test_a_checkpoint_saved_after_fit_holds_ddp_s_optimizer_state_and_resumes_like_it(parity_run):
    """[Note: optimizer state after fit]: each rank kept its pieces of Adam's moments; the save gathered them to
    rank 0 in the plain format, as DDP's rank 0 writes them, and the resume goes on from them. The optimizer itself
    holds no state there, and reading it raises naming ``materialize_optimizer_state=True``, which gives every rank
    DDP's whole state."""
    out, rc, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE save_after_fit rank={r}" in log, log[-3000:]
    d = torch.load(out / "save_after_fit.pt", weights_only=False)
    ref, got = d["ref"]["saved"], d["got"]["saved"]
    (ro,), (go,) = ref["optimizer_states"], got["optimizer_states"]
    assert len(go["state"]) == len(ro["state"]) > 0
    for k, st in ro["state"].items():
        for name, v in st.items():
            torch.testing.assert_close(go["state"][k][name], v, rtol=0, atol=0, msg=lambda m: f"{k}.{name}: {m}")
    for key in ("global_step", "loops", "lr_schedulers"):
        assert got[key] == ref[key], key
    for k, v in d["ref"]["resumed"].items():
        torch.testing.assert_close(d["got"]["resumed"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    for r in (0, 1):  # what the optimizer itself holds after fit, on every rank
        held = torch.load(out / f"save_after_fit.held.rank{r}.pt", weights_only=False)
        assert "materialize_optimizer_state=True" in held["chunk"] and "chunk_param" not in held, held["chunk"]
        assert held["whole"]["param_groups"] == held["ddp"]["param_groups"]
        assert held["whole"]["state"].keys() == held["ddp"]["state"].keys() and held["ddp"]["state"]
        for k, st in held["ddp"]["state"].items():
            for name, v in st.items():
                torch.testing.assert_close(held["whole"]["state"][k][name], v, rtol=0, atol=0)


@pytest.mark.cases("whole_optimizer_state", "whole_optimizer_state_user")
def test_the_whole_optimizer_state_read_and_reset_between_steps_is_ddp_s(parity_run):
    """[Note: the whole optimizer state of a parameter] on two ranks, each parameter's state cut across their
    shards: at the start of fit and after every micro-batch each rank's ``full_optimizer_state()`` holds DDP's
    ``optimizer.state`` to the bit, its ``optimizer_state_norms()`` are the norms of DDP's moments to rounding
    ([Note: optimizer state norms from the pieces]), and the head's moments and count zeroed after step 6 train on
    as DDP's (test_parity_with_ddp). Also as a user meets it (``whole_optimizer_state_user``): ranks of different
    limits, the automatic chunk size, a reordered model stepped in backward, accumulation (sharded: DDP's to
    rounding), and a resume from step 4 whose state the read at the start takes in before the first step."""
    out, rc, log = parity_run
    assert rc == 0, log[-3000:]
    for case, reads, exact, resumed in (
        ("whole_optimizer_state", 1 + 16, True, False),
        ("whole_optimizer_state_user", 1 + 24, False, True),  # accumulation sharded: DDP's to rounding
    ):
        for r, s in enumerate(stats(out, case)):
            (seen,) = s["seen"]
            assert len(seen) == reads, (case, r, seen)
            assert all((bits or not exact) and close and norms for bits, close, norms, _ in seen), (case, r, seen)
            assert [had for *_, had in seen] == [resumed] + [True] * (reads - 1), (case, r, seen)


@pytest.mark.cases("unfreeze", "plain")
def test_unfreezing_and_refreezing_mid_training_train_as_ddp(parity_run):
    """[Note: requires_grad changed]: with the defaults on 2 ranks, blocks[0] unfrozen at step 6 and the embedding
    frozen from 6 to 14 train bit for bit as DDP dropping those gradients. Before, the unfrozen block never moved."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE unfreeze rank={r}" in log, log[-3000:]
    d = torch.load(out / "unfreeze.pt")
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, msg=lambda m: f"{k}: {m}", rtol=0, atol=0)
    init = torch.load(out / "plain.pt")["init"]
    assert not torch.equal(d["got"]["blocks.0.1.weight"], init["blocks.0.1.weight"])


@pytest.mark.cases("full_parameters")
def test_weights_clamped_between_steps_inside_full_parameters_train_as_ddp(parity_run):
    """[Note: parameters outside a step]: with the defaults and with host placement. Before, a callback reading a
    weight between steps crashed both ranks (a segmentation fault: the payloads are released after each step with
    several ranks); outside the block a read of it now raises, naming it ([Note: released parameters read between
    steps])."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE full_parameters rank={r}" in log, log[-3000:]
    d = torch.load(out / "full_parameters.pt")
    for placement in ("auto", "host"):
        got = d[placement]
        assert got["norms"] == d["ref_norms"], placement
        # Lightning's grad_norm inside full_parameters(with_grads=True): DDP's averaged gradients, bit for bit
        assert got["grad_norms"] == d["ref_grad_norms"], placement
        # strategy.grad_norm, from the shards without a gather ([Note: gradient norms from the shards]): the same
        # names; the 2-norms the root of the ranks' summed squares (DDP's up to rounding), the inf-norms exact
        _same_norms(d["ref_sharded_norms"], got["sharded_norms"], placement)
        assert got["seen_outside"] == ["refused"] * 12, placement
        assert got["seen_kept"] == ["refused"] * 12, placement  # NaN before: no attribute read armed the check
        assert torch.equal(got["saved_inside"], d["ref"]["blocks.0.0.weight"]), placement  # state_dict() inside
        for k, v in d["ref"].items():
            torch.testing.assert_close(got["got"][k], v, msg=lambda m: f"{placement} {k}: {m}", rtol=0, atol=0)
    assert "ChunkError: state_dict() of a module trained by chunk_offload on 2 ranks" in d["outside_error"]
    assert "still wait in their gradient payloads (sharded_accumulation=False" in d["waiting_error"]
    # the automatic chunk size under a limit below this rank's share, a reordered model, accumulation: the same
    # values as without the limit, bit for bit, and the clamp holds
    free, limited = d["hard"][False], d["hard"][True]
    assert limited["evictions"] > 0 and free["evictions"] == 0
    for k, v in free["state"].items():
        assert torch.equal(limited["state"][k], v), k
    assert all(v.abs().max() <= 0.05 for k, v in limited["state"].items() if k.startswith("blocks_reversed.3."))
    # strategy.grad_norm: the same gradients, split into other pieces by the limit's chunk size: the same names and
    # inf-norms, 2-norms summed from other pieces (rounding)
    assert len(free["sharded_norms"]) == 8  # one an optimizer step
    _same_norms(free["sharded_norms"], limited["sharded_norms"], "limited")
    # a gate's parameter with a gradient on one rank only, each step: named on both, as DDP's grad_norm names it
    ref, got = d["gated"]["ref"], d["gated"]["got"]
    assert len(got) == len(ref) == 8 and all(any(".scale" in k for k in step) for step in got)
    _same_norms(ref, got, "gated")


def _same_norms(ref: list[dict], got: list[dict], what: str) -> None:
    for ref_step, got_step in zip(ref, got, strict=True):
        assert got_step.keys() == ref_step.keys() and any("inf_norm/" in k for k in got_step), what
        for k, v in ref_step.items():
            assert got_step[k] == (v if "inf" in k else pytest.approx(v, rel=1e-5, abs=1e-7)), (what, k)


@pytest.mark.cases("edited_checkpoint")
def test_a_checkpoint_holds_what_on_save_checkpoint_left_and_resumes_as_ddp(parity_run):
    """[Note: the state_dict of a sharded save]: frozen weights dropped, an entry added and the head replaced in
    on_save_checkpoint, on two ranks; before, the entry was lost (on_load_checkpoint found no key)."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE edited_checkpoint rank={r}" in log, log[-3000:]
    d = torch.load(out / "edited_checkpoint.pt")
    for k, v in d["ddp"]["state"].items():
        assert torch.equal(d["chunk"]["state"][k], v), k
    assert torch.equal(d["chunk"]["entry"], torch.tensor([3.0, 4.0]))
    assert d["chunk"]["evictions"] > 0  # under the device limit
    ck = torch.load(out / "edited_chunk" / "step=6.ckpt" / "meta.pt", weights_only=False)["chunk_checkpoint"]
    assert not all(c["written"] for c in ck["chunks"])


@pytest.mark.cases("ema")
def test_chunk_ema_on_two_ranks_is_ddp_s_ema_weight_averaging_and_resumes_on_one(parity_run):
    """[Note: a sharded EMA]: each rank averages its own shards; validation, the final weights and a resume from a
    step-4 checkpoint equal DDP with Lightning's EMAWeightAveraging bit for bit, with the average in files and the
    shards on disk too ([Note: the average under a host limit]). The two-rank sharded checkpoints then resume on one
    rank as DDP's plain file does with strategy="auto"."""
    import lightning as L
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_chunk import ChunkEMA, ChunkOffloadStrategy, OffloadOptions
    from tests.models import LogsValLoss, token_data

    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE ema rank={r}" in log, log[-3000:]
        # a host limit given to rank 1 alone, no disk_dir: refused on both ranks ([Note: one limit for every rank])
        assert f"EMA-REFUSED rank={r}: ChunkEMA with host_memory_limit=100000 keeps" in log, log[-3000:]
    d = torch.load(out / "ema.pt")
    for name in ("chunk", "files"):  # files: [Note: the average under a host limit], the shards on disk too
        assert d[name]["val"] == d["ddp"]["val"] and len(d["ddp"]["val"]) == 4
        for part in ("state", "resumed"):
            for k, v in d["ddp"][part].items():
                assert torch.equal(d[name][part][k], v), (name, part, k)
    assert d["files"]["ema_host_bytes"] == 0 < d["files"]["ema_disk_bytes"] and d["files"]["disk_shards"] > 0
    assert d["chunk"]["ema_host_bytes"] > 0 == d["chunk"]["disk_shards"]
    # the defaults under a limit, a reordered model, accumulation, a resume at step 3: as without the limit, bit
    # for bit, and as DDP to sharded accumulation's rounding
    limited, free, padded, ddp = (d[f"hard_{n}"] for n in ("limited", "free", "padded", "ddp"))
    assert limited["evictions"] > 0 and free["evictions"] == 0
    # padded: a chunk whose shard on rank 1 is padding alone ([Note: the same averages on every rank]); it hung
    for k, v in free["state"].items():
        assert torch.equal(limited["state"][k], v) and torch.equal(padded["state"][k], v), k
        torch.testing.assert_close(v, ddp["state"][k], **ROUNDING["accumulate"], msg=k)
    finals = []
    in_files = dict(host_memory_limit="300kB", offload=OffloadOptions(optimizer_kernel="loop", disk_dir=out / "one"))
    for strategy, ema, ckpt in [
        ("auto", EMAWeightAveraging(decay=0.8), "ema_ddp"),
        (ChunkOffloadStrategy(offload=OffloadOptions(optimizer_kernel="loop")), ChunkEMA(decay=0.8), "ema_chunk"),
        (ChunkOffloadStrategy(**in_files), ChunkEMA(decay=0.8), "ema_files"),  # from files on 2 ranks to files on 1
    ]:
        L.seed_everything(7, verbose=False)
        model = LogsValLoss()
        quiet_trainer(strategy=strategy, max_steps=8, limit_val_batches=0, callbacks=[ema]).fit(
            model, token_data(), ckpt_path=out / ckpt / "step=4.ckpt"
        )
        finals.append(model.state_dict())
    for k, v in finals[0].items():
        assert torch.equal(finals[1][k], v) and torch.equal(finals[2][k], v), k


@pytest.mark.cases("grad_penalty_limit")
def test_a_gradient_penalty_under_a_limit_with_the_defaults_equals_the_run_without_it(parity_run):
    """The penalty's first backward delivers no gradient and must not end the micro-batch's ([Note: a backward that
    delivers no gradient]); under a limit, reordered, accumulating, and stepping in backward, as without the limit."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE grad_penalty_limit rank={r}" in log, log[-3000:]
    d = torch.load(out / "grad_penalty_limit.pt")
    assert d["free"]["evictions"] == 0 and d["limited"]["evictions"] > 0
    assert d["limited_early"]["chunks_stepped_in_backward"] > 0
    for name in ("limited", "limited_early"):
        for k, v in d["free"]["state"].items():
            assert torch.equal(d[name]["state"][k], v), (name, k)


@pytest.mark.cases("batchnorm")
def test_every_rank_s_batchnorm_statistics_and_validation_losses_are_ddp_s(parity_run):
    """[Note: buffers as DDP syncs them]: rank 0's running statistics before each forward DDP syncs them in (not
    after validation, nor after a micro-batch that does not step); before this every rank but 0 evaluated with its
    own (0.12 from DDP's running mean on rank 1). Parameters, buffers and validation losses, on each rank; bit for
    bit where DDP's run is matched exactly, and with the defaults under a limit, resumed in the middle."""
    out, rc, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE batchnorm rank={r}" in log, log[-3000:]
        got = torch.load(out / f"batchnorm.rank{r}.pt")
        assert got["chunk"]["val"] == got["ddp"]["val"] and len(got["ddp"]["val"]) == 5  # 1 sanity + 2 x 2
        for k, v in got["ddp"]["state"].items():
            torch.testing.assert_close(got["chunk"]["state"][k], v, rtol=0, atol=0, msg=lambda m: f"rank {r} {k}: {m}")
        # the defaults (automatic chunk size, sharded accumulation) under a limit below the parameter bytes, on a
        # model used in another order than registered, resumed from step 4 as DDP is: the statistics stay DDP's on
        # every rank (to sharded accumulation's rounding, which Adam carries into the weights: 1.4e-5 at most)
        hard, ddp = got["defaults_resumed"], got["ddp_resumed"]
        assert hard["evictions"] > 0 and len(ddp["val"]) == 2
        torch.testing.assert_close(torch.tensor(hard["val"]), torch.tensor(ddp["val"]), rtol=1e-5, atol=0)
        for k, v in ddp["state"].items():
            tol = dict(rtol=0, atol=1e-6) if k.startswith("bn.running") else dict(rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(hard["state"][k], v, **tol, msg=lambda m: f"rank {r} {k}: {m}")


@pytest.mark.cases("resume")
def test_checkpoint_written_on_two_ranks_resumes_like_ddp_and_sync_dist_reduces(parity_run):
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE resume rank={r}" in log, log[-3000:]
        # self.log(..., sync_dist=True) of the rank index gives the mean over both ranks, with both strategies
        assert json.loads((out / f"resume.rank{r}.json").read_text()) == {"ddp": 0.5, "chunk": 0.5}
        # [Note: a resume reads what the rank holds]: each rank asks for its half of the saved elements, where it
        # read every saved chunk whole (about 46 and 50% here: the resume's layout is not the saving run's)
        read = json.loads((out / f"resume.read{r}.json").read_text())
        assert 0 < read["asked"] <= 0.6 * read["saved"], read
    d = torch.load(out / "resume.pt")
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    # LightningModule.load_from_checkpoint of the directory both ranks wrote: DDP's file's values, bit for bit
    ddp, chunk = d["loaded"]["ddp"], d["loaded"]["chunk"]
    assert list(chunk) == list(ddp)
    for k, v in ddp.items():
        torch.testing.assert_close(chunk[k], v, rtol=0, atol=0, msg=lambda m: f"loaded {k}: {m}")


@pytest.mark.cases("save_inside_a_step")
def test_a_save_inside_a_step_resumes_like_ddp_saving_at_the_next_batch(parity_run):
    """[Note: a save inside a step]: both ranks defer the save asked for after backward to the next batch's start,
    the point where DDP was asked; resumed from each to step 10, the parameters are DDP's."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE save_inside_a_step rank={r}" in log, log[-3000:]
    d = torch.load(out / "save_inside_a_step.pt")
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("fmt", [pytest.param(fmt, marks=pytest.mark.cases(f"weights_{fmt}")) for fmt in FORMATS])
def test_weights_load_on_two_ranks_and_train_like_ddp(parity_run, fmt):
    check_parity(*parity_run, f"weights_{fmt}")


@pytest.mark.cases("uneven_batches")
def test_ranks_with_different_numbers_of_batches_stop_together_naming_the_counts(parity_run):
    """[Note: the same number of batches on every rank]: rank 0 has 3 batches and rank 1 has 2. Before, rank 0's
    third forward waited in an all-gather that rank 1 never issued: a timeout after ``collective_timeout_s`` blaming
    control flow at a collective far from the cause (a hang on NCCL), or in evaluation it ran where every chunk
    happened to be gathered. Now both ranks raise at batch 1, before running it, naming each rank's count: in
    training and in validation; the same loader under ``limit_val_batches=2`` runs. Predict, whose counts differ
    with Lightning's own sampler (it failed so), returns DDP's predictions on each rank: rank 1 repeats its last
    batch while rank 0 runs its third."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE uneven_batches rank={r}" in log, log[-3000:]
        done = json.loads((out / f"uneven_batches.rank{r}.json").read_text())
        assert done["validate_limited"] == "ran"
        assert "training batches (rank 0: 3, rank 1: 2): at the loop's batch 1" in done["train"], done
        assert "limit_train_batches or max_steps" in done["train"]
        assert "validation batches (rank 0: 3, rank 1: 2): at the loop's batch 1" in done["validation"], done
        assert "limit_val_batches" in done["validation"]
        for stage in ("predict", "predict_sampled"):  # rank 0: 3 batches; rank 1: 2, and its last once more
            assert done[stage] == {"batches": 3 - r, "same_as_ddp": True, "calls": 3}, (stage, done)
        for stage in ("train", "validation"):
            assert done[stage].startswith(f"[rank {r}]") and "rank 1's dataloader ends" in done[stage]
            assert "use_distributed_sampler=True" in done[stage]


@pytest.mark.cases("clip_over_optimizer")
def test_torch_s_norm_clipping_over_the_optimizer_s_parameters_is_refused_and_clipping_by_value_trains_as_ddp(
    parity_run,
):
    """[Note: a norm over the optimizer's gradient shards]: on two ranks the optimizer's parameters are each rank's
    shards. torch's ``clip_grad_norm_`` over them took this rank's norm, and each rank clipped by its own factor:
    0.0016 off DDP after a few steps (a third of an update), silently. Now it raises on every rank, before the step
    (a call a param group, ``get_total_norm`` after backward, after a manual backward), naming the ways that take
    the norm over every rank; clipping by value, element-wise, trains as DDP to the bit."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE clip_over_optimizer rank={r}" in log, log[-3000:]
        done = json.loads((out / f"clip_over_optimizer.rank{r}.json").read_text())
        for how in ("group_norms", "total_norm", "manual"):
            assert "this rank's shards" in done[how] and "on 2 ranks" in done[how], (how, done)
            assert "gradient_clip_val" in done[how] and "full_parameters(with_grads=True)" in done[how]
        assert done["value_as_ddp"] is True


@pytest.mark.cases("backward_raised")
def test_a_backward_that_raised_on_every_rank_is_ended_and_the_step_goes_on_as_ddp_s(parity_run):
    """[Note: a backward that raised] on two ranks: the out-of-memory is caught in the user's ``backward`` hook on
    both; the end of the backward runs its collectives on both, and the step with the gradients that arrived,
    clipped by norm, is DDP's on a model with no gradient below the failure, up to the norm's rounding; stepped in
    backward, the chunks' guesses were undone first."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE backward_raised rank={r}" in log, log[-3000:]
        got = json.loads((out / f"backward_raised.rank{r}.json").read_text())
        assert got["after"] < 1e-6 and got["guessed"] < 1e-6 and got["speculation_rollbacks"] > 0, got


@pytest.mark.cases("models_differ")
def test_ranks_that_built_different_models_fail_together_naming_the_first_parameter_that_differs(parity_run):
    """[Note: the same model on every rank]: rank 1's block is wider, then rank 1 has a block more, as DDP refuses
    as it wraps. Before, run as NCCL, rank 0 aborted in the first broadcast (gloo: ``EnforceNotMet``, sizes 12288 vs
    11264) and rank 1 timed out blaming control flow; on NCCL, a hang or values read past a buffer."""
    out, _, log = parity_run
    said = []
    for r in (0, 1):
        assert f"CASE-DONE models_differ rank={r}" in log, log[-3000:]
        said.append(json.loads((out / f"models_differ.rank{r}.json").read_text()))
    assert said[0] == said[1]  # every rank raises the same error
    wider, deeper = said[0]["wider"], said[0]["deeper"]
    assert "differ first at entry 3" in wider
    assert (
        "rank 0: parameter 'blocks.0.1.weight' of shape (64, 32)" in wider
        and "rank 1: parameter 'blocks.0.1.weight' of shape (72, 32)" in wider
    )
    assert (
        "(rank 0: 17, rank 1: 23)" in deeper
        and "rank 1: parameter 'blocks.2.0.weight'" in deeper
        and "as DDP requires" in deeper
    )


@pytest.mark.cases("fits_again")
def test_fit_after_fit_leaves_no_sockets_or_threads_behind(parity_run):
    """Each fit's gloo groups are destroyed at its teardown: the descriptors and threads after the sixth fit are
    those after the second (before: 5 descriptors and 3 threads more a fit run as NCCL, the roll call's group; 35
    and 21 with gloo's own defaults, a group per kind of collective and the agreement check's)."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE fits_again rank={r}" in log, log[-3000:]
        seen = json.loads((out / f"fits_again.rank{r}.json").read_text())
        (fds, threads), (fds_last, threads_last) = seen[1], seen[-1]
        assert fds_last <= fds + 8 and threads_last <= threads + 4, seen


@pytest.mark.cases("static_limits")
def test_static_placement_counts_its_device_shards_in_every_limit_check(parity_run):
    """[Note: the shards a placement keeps on the device]: under 1.3x the parameter bytes ``static`` passed set-up
    and stopped in the sanity check's first forward, naming as the smallest limit one below the limit given; under
    2x it trained, its shards, payloads and traced activations past the limit. Now the first is refused at set-up
    and the second after the warm-up, each naming a limit above the one given; at the one the second names, the
    run is DDP's bit for bit. Rank 1 asks 2.2x for the second: its error names the ranks' smallest limit, and
    its own."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE static_limits rank={r}" in log, log[-3000:]
        done = torch.load(out / f"static_limits.rank{r}.pt")
        for stage, fraction, words in (
            ("set-up", 1.3, "before any activations"),
            ("warm-up", 2.0, "the warm-up step needs"),
        ):
            error = done[stage]
            assert isinstance(error, str) and words in error, (stage, error)
            assert "of shards placement='static' keeps on the device" in error and "offload_fraction" in error
            smallest = int(error.split("The smallest limit that ")[1].split("work is ")[1].split(" bytes")[0])
            assert smallest > int(done["param_bytes"] * fraction), error
            assert error.startswith(f"device_memory_limit={int(done['param_bytes'] * fraction)} bytes"), error
        own = f"(the smallest of the ranks' limits; this rank's was {int(done['param_bytes'] * 2.2)} bytes"
        assert (own in done["warm-up"]) == (r == 1), done["warm-up"]
        assert done["named_limit"] > 2 * done["param_bytes"]
        assert isinstance(done["named"], dict), done["named"]
        assert all(torch.equal(v, done["named"][k]) for k, v in done["ddp"].items())


@pytest.mark.cases("written_after_a_forward")
def test_parameters_written_after_a_forward_outside_a_step_are_refused_on_every_rank(parity_run):
    """Two ranks agree to make the copies again at the first forward after a step; a write after it (eval() between
    two forwards in on_train_epoch_end) is named on both, not computed with stale copies (one rank makes the copies
    again at every forward: test_optimizers_and_precision.py)."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE written_after_a_forward rank={r}" in log, log[-3000:]
        said = json.loads((out / f"written_after_a_forward.rank{r}.json").read_text())
        assert "written after the first forward since the last step" in said and "optimizer.eval()" in said, said


@pytest.mark.cases("backbone_resume")
def test_backbone_finetuning_resumed_from_a_sharded_directory_after_the_unfreezing_agrees_on_every_rank(parity_run):
    """[Note: finetuning callbacks] on two ranks: the group the callback added is added back inside the sharded load
    (a collective repack), whatever the placement, and both ranks end with the same bits."""
    out, _, log = parity_run
    for r in (0, 1):
        assert f"CASE-DONE backbone_resume rank={r}" in log, log[-3000:]
    ranks = [torch.load(out / f"backbone_resume.rank{r}.pt") for r in (0, 1)]
    for got in ranks:
        assert got["host"]["groups"] == got["limit"]["groups"] == 2 and got["host"]["dir"]
        for k, v in got["host"]["state"].items():
            assert torch.equal(got["limit"]["state"][k], v), k
    for k, v in ranks[0]["host"]["state"].items():
        assert torch.equal(ranks[1]["host"]["state"][k], v), k
