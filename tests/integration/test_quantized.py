"""QLoRA: bitsandbytes' 4-bit bases under chunk_offload, against plain Lightning's bits ([Note: quantized weights] in
``engine/config.py``, [Note: quantizing where Lightning does] in ``quantized.py``)."""

import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision
from tests.children import child_env

pytest.importorskip("bitsandbytes")
from tests.quantized_models import HFQLoRA, QLoRANet, qlora_data, save_tiny_llama, trained  # noqa: E402

STEPS = 4


def fit(strategy, model_kwargs, steps=STEPS, **trainer_kwargs):  # noqa: ANN001, ANN003, ANN201
    L.seed_everything(0, verbose=False)
    model = QLoRANet(**model_kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model, qlora_data())
    return model


def chunk(**kw):  # noqa: ANN003, ANN201
    return ChunkOffloadStrategy(placement="host", optimizer_kernel="loop", **kw)


@pytest.mark.parametrize(
    ("storage", "quantize", "precision"),
    [
        ("float32", False, "bf16-mixed"),  # its codes were cast to a bf16 payload of half the bytes: the kernel failed
        ("bfloat16", True, "bf16-mixed"),
        ("bfloat16", False, "16-mixed"),  # without fp32 payloads for vectors: cast to fp16, other weights decoded
        ("float32", False, "32-true"),
    ],
)
def test_a_qlora_base_trains_to_plain_lightning_s_bits(storage, quantize, precision):
    """A base quantized at set-up (``quantize=False``: as Lightning's ``model.to(device)`` quantizes it; it failed in
    bitsandbytes' forward on the float weights) or before, its codes never cast: the adapters and head train to plain
    Lightning's bits, resident and under a limit that evicts, and the base's codes are the same after fit."""
    kw = dict(storage=storage, quantize=quantize)
    if precision == "16-mixed":  # a CPU Trainer makes precision='16-mixed' bf16-mixed
        scaler = torch.amp.GradScaler("cpu")
        ref = fit("auto", kw, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        plugin = dict(plugins=[ChunkPrecision("16-mixed", fp32_embeddings_and_norms=False)])
    else:
        ref, plugin = fit("auto", kw, precision=precision), dict(precision=precision)
    for strategy in (chunk(), chunk(device_memory_limit=60_000, chunk_numel=8192)):
        got = fit(strategy, kw, **plugin)
        assert type(got.l1.base.weight).__name__ == "Params4bit" and got.l1.base.weight.quant_state is not None
        assert torch.equal(got.l1.base.weight.view(torch.uint8), ref.l1.base.weight.view(torch.uint8))
        want = trained(ref)
        for name, value in trained(got).items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_hugging_face_qlora_model_trains_to_plain_lightning_s_bits(tmp_path):
    """transformers' 4-bit loading, ``peft``'s k-bit preparation and adapters: plain Lightning's bits under
    bf16-mixed with fp32 embeddings and norms (what its autocast computes in fp32). Left in eval mode, as
    ``from_pretrained`` leaves it, bitsandbytes rewrote each weight's layout in its first forward on this CPU and the
    engine refused the write ([Note: bitsandbytes' CPU layout]): it trains, within a rounding of plain Lightning."""
    save_tiny_llama(str(tmp_path / "llama"))
    data = torch.utils.data.DataLoader(
        torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(2)), batch_size=4
    )
    plugin = ChunkPrecision("bf16-mixed", fp32_embeddings_and_norms=True)
    for train, tol in ((True, dict(rtol=0, atol=0)), (False, dict(rtol=0, atol=0.02))):
        got = {}
        for name, kw in (
            ("ref", dict(strategy="auto", precision="bf16-mixed")),
            ("chunk", dict(strategy=chunk(), plugins=[plugin])),
        ):
            L.seed_everything(0, verbose=False)
            model = HFQLoRA(str(tmp_path / "llama"), train=train)
            L.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=STEPS,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                **kw,
            ).fit(model, data)
            got[name] = trained(model)
        assert len(got["ref"]) == 8  # four adapted projections, A and B each
        for key, value in got["chunk"].items():
            torch.testing.assert_close(value, got["ref"][key], msg=lambda m, k=key, t=train: f"{k} ({t=}): {m}", **tol)


def test_a_4_bit_weight_in_bitsandbytes_default_uint8_container_is_refused_naming_the_float_one():
    with pytest.raises(
        TypeError,
        match=r"'l1\.base\.weight' is a 4-bit weight in a torch\.uint8 container.*"
        r"quant_storage=torch\.bfloat16",
    ):
        fit(chunk(), dict(storage="uint8", quantize=True), steps=1)


def test_quant_states_go_to_the_device_and_unquantized_weights_are_quantized_once():
    """What ``model.to(device)`` does to a ``Params4bit``, done by ``quantize_for`` without moving the codes to the
    device for good: an unquantized weight is quantized (in place: the module keeps the same parameter), a quantized
    one's ``quant_state`` moves (a recorder stands for the device here)."""
    from lightning_chunk.quantized import quantize_for

    model = QLoRANet(quantize=False)
    weight = model.l1.base.weight
    assert quantize_for(model, torch.device("cpu")) == 2 and model.l1.base.weight is weight and weight.bnb_quantized
    moved = []

    class Recorder:
        def to(self, device: torch.device) -> None:
            moved.append(device)

    weight.quant_state, device = Recorder(), torch.device("meta")
    assert quantize_for(model, device) == 0 and moved == [device]


@pytest.mark.slow
def test_two_ranks_train_a_qlora_model_to_ddp_s_bits(tmp_path):
    """Sharded across two ranks, the codes gathered for each forward: DDP's bits, the codes unchanged."""
    path = tmp_path / "trained.pt"
    cmd = [sys.executable, "-m", "tests.quantized_models", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(path)
    assert torch.equal(out["chunk"]["codes"].view(torch.uint8), out["ddp"]["codes"].view(torch.uint8))
    for name, value in out["chunk"]["trained"].items():
        torch.testing.assert_close(value, out["ddp"]["trained"][name], rtol=0, atol=0)
