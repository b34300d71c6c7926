"""Hugging Face causal LMs under chunk_offload, through the example's ``CausalLM``: fine-tuning from a
``save_pretrained`` directory in parity with plain Lightning under a device limit that evicts, gradient
checkpointing, ``torch.compile``, the init of a model built from a config on the meta device, and bad weights."""

from __future__ import annotations

import json
import math
import sys

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")

from lightning_chunk import (  # noqa: E402
    ChunkOffloadStrategy,  # noqa: E402
    MemoryOptions,
    OffloadOptions,
)
from lightning_chunk.engine.files.weights import WeightsError  # noqa: E402
from tests.hf.models import CONFIGS, Batches, config, load_example, save_pretrained  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

EXACT = dict(rtol=0, atol=0)
STEPS = 6
# device limits a little above each model's traced activations (1-2.5 MB at 4 x 32 tokens) plus its parameter
# bytes: well below the training state (16 bytes a parameter), so placement evicts every step
LIMITS = {"gpt2": 3_000_000, "llama": 1_700_000, "opt": 1_250_000, "mixtral": 2_200_000}


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {kind: save_pretrained(kind, root / kind) for kind in LIMITS}


def fit(example, strategy, steps: int = STEPS, **model_kw):
    torch._dynamo.reset()
    L.seed_everything(3, verbose=False)
    model = example.CausalLM(lr=1e-3, warmup_steps=1, **model_kw)
    trainer = quiet_trainer(strategy=strategy, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, Batches())
    return model


def same_params(ref, got) -> None:
    for (n, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m: f"{n}: {m}", **EXACT)


@pytest.mark.parametrize("kind", list(LIMITS))
def test_fine_tuning_from_save_pretrained_is_bit_exact_with_auto_under_a_limit(example, pretrained, kind):
    """auto: ``from_pretrained``. chunk_offload: built on the meta device, the weights streamed from the shards into
    the chunks (what the files lack, Llama's rotary frequencies, initialised by HFInit). Mixtral's file holds a
    tensor per expert, merged into each layer's 3D experts as from_pretrained merges them (before, nothing matched)."""
    ref = fit(example, "auto", pretrained=str(pretrained[kind]))
    strategy = ChunkOffloadStrategy(
        device_memory_limit=LIMITS[kind],
        memory=MemoryOptions(chunk_numel=32768 if kind == "mixtral" else 16384),  # Mixtral's experts: 32768
        offload=OffloadOptions(optimizer_kernel="loop"),
    )
    got = fit(example, strategy, pretrained=str(pretrained[kind]))
    same_params(ref, got)
    assert strategy.weights == str(pretrained[kind])  # set by the module's configure_model
    stats = strategy.memory_stats()
    assert stats["evictions"] > 0 and stats["device_chunk_bytes_peak"] <= LIMITS[kind]
    for (n, a), (_, b) in zip(ref.named_buffers(), got.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, msg=lambda m: f"{n}: {m}", **EXACT)


@pytest.mark.parametrize("placement", ["auto", "host"])
def test_hf_gradient_checkpointing_is_bit_exact(example, pretrained, placement):
    """``use_reentrant=False`` (the example's): each layer's forward runs again inside the backward of its last
    module. Host placement, which releases each payload after use, once released that module's chunk after its
    recomputed forward, under its own backward ([Note: recomputation])."""
    kw = dict(pretrained=str(pretrained["llama"]), gradient_checkpointing=True)
    ref = fit(example, "auto", **kw)
    m = ref.hf_model  # transformers 5 renamed the attribute (the old one warns, and goes in 6)
    assert getattr(m, "is_activation_checkpointing", None) or m.is_gradient_checkpointing
    got = fit(
        example,
        ChunkOffloadStrategy(
            placement=placement,
            device_memory_limit=LIMITS["llama"],
            memory=MemoryOptions(chunk_numel=16384),
            offload=OffloadOptions(optimizer_kernel="loop"),
        ),
        **kw,
    )
    same_params(ref, got)
    plain = fit(example, "auto", pretrained=str(pretrained["llama"]))  # recomputation changes nothing in fp32
    same_params(plain, got)


@pytest.mark.slow  # a child process, torch.compile or a memory measurement: the full suite's
def test_compiled_hf_model_is_bit_exact_and_quiet(example, pretrained, monkeypatch):
    """GPT-2 compiled (the dynamo graph breaks at the engine's hooks). The first compiled runs printed
    "AttributeError: '_Saved' object has no attribute 'key'" from the tracer at every step."""
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: raised.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    kw = dict(pretrained=str(pretrained["gpt2"]), compile="aot_eager")
    ref = fit(example, "auto", **kw)
    strategy = ChunkOffloadStrategy(
        device_memory_limit=LIMITS["gpt2"],
        memory=MemoryOptions(chunk_numel=16384),
        offload=OffloadOptions(optimizer_kernel="loop"),
    )
    got = fit(example, strategy, **kw)
    assert type(got.model).__name__ == "OptimizedModule"
    same_params(ref, got)
    assert strategy.memory_stats()["evictions"] > 0
    assert raised == []


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_a_model_from_a_config_is_initialised_by_its_own_rules_on_the_meta_device(example, kind):
    """Built from a config in configure_model under chunk_offload (meta device), initialised module by module by
    HFInit: buffers, norms and biases equal an eager ``from_config``; every weight has the spread of the model's own
    ``_init_weights``, GPT-2's residual projections included (scaled by 1/sqrt(2 n_layer) from their parent
    modules, which own no tensor); the default torch init (kaiming uniform) would give another."""
    from transformers import AutoModelForCausalLM

    deeper = {"n_layer": 8} if kind == "gpt2" else {"num_hidden_layers": 4}
    L.seed_everything(0, verbose=False)
    model = example.CausalLM(config={**CONFIGS[kind], **deeper})
    chunk_numel = 32768 if kind == "mixtral" else 16384  # a layer's experts: 32768 elements
    trainer = quiet_trainer(
        strategy=ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=chunk_numel)), enable_checkpointing=True
    )
    trainer.validate(model, Batches(n=4), verbose=False)  # setup initialises; teardown gives the values back
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config(kind, **deeper))
    got = dict(model.hf_model.named_parameters())
    for name, ref in eager.named_parameters():
        value = got[name].detach()
        assert not value.isnan().any(), name
        if ref.std() == 0:  # ones and zeros
            torch.testing.assert_close(value, ref.detach(), **EXACT, msg=name)
        else:  # another draw of the same init: same spread
            assert math.isclose(value.std().item(), ref.std().item(), rel_tol=0.2), (name, value.std(), ref.std())
    for (name, ref), (_, b) in zip(eager.named_buffers(), model.hf_model.named_buffers(), strict=True):
        torch.testing.assert_close(b, ref, **EXACT, msg=name)
    if kind == "gpt2":
        std = got["transformer.h.0.attn.c_proj.weight"].std().item()
        assert math.isclose(std, 0.02 / math.sqrt(2 * 8), rel_tol=0.2), std


def broken(path, kind: str):
    if kind == "no_index":  # several shards and no index: which tensors are where?
        (path / "model.safetensors.index.json").unlink()
        return ".safetensors files and no *.safetensors.index.json"
    if kind == "missing_shard":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[-1]
        (path / shard).unlink()
        return f"{shard}"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["no_index", "missing_shard"])
def test_broken_pretrained_directories_are_refused_before_training(example, tmp_path, kind):
    d = save_pretrained("llama", tmp_path / "model", max_shard_size="200KB")
    assert len(list(d.glob("*.safetensors"))) >= 2
    needle = broken(d, kind)
    strategy = ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=16384))
    with pytest.raises(WeightsError, match="safetensors") as e:
        fit(example, strategy, pretrained=str(d))
    assert needle in str(e.value)


def test_a_config_that_does_not_match_the_weights_names_the_tensors(example, pretrained):
    """The module's config says 3 layers, the files hold 2: one error listing what is missing, before any step."""
    with pytest.raises(WeightsError, match=r"missing from the file \(\d+\): model\.model\.layers\.2\.") as e:
        fit(
            example,
            ChunkOffloadStrategy(memory=MemoryOptions(chunk_numel=16384)),
            pretrained=str(pretrained["llama"]),
            config={"num_hidden_layers": 3},
        )
    assert "nothing was loaded" in str(e.value)


def test_hf_init_applies_ancestor_rules_to_the_module_alone_and_lets_temporaries_be_written():
    """HFInit on a toy model with HF's shape: the leaf rule builds its value in a temporary written in place; the
    parent's rule writes its two children. Initialising one child takes the parent's rule for it and leaves the
    sibling (a placeholder, or a value already packed) untouched."""
    from lightning_chunk.hf import HFInit

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Module()
            self.block.a, self.block.b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)

        def _init_weights(self, m: torch.nn.Module) -> None:
            if isinstance(m, torch.nn.Linear):
                tmp = torch.empty_like(m.weight)
                tmp.fill_(3.0)  # an in-place write into a temporary
                m.weight.copy_(tmp)
            elif m is self.block:
                m.b.weight.fill_(7.0)  # the parent's rule for one child

    toy = Toy()
    with torch.no_grad():
        toy.block.a.weight.zero_(), toy.block.b.weight.zero_()
    init = HFInit(toy)
    init(toy.block.a)
    assert toy.block.a.weight.eq(3.0).all() and toy.block.b.weight.eq(0.0).all()
    init(toy.block.b)
    assert toy.block.b.weight.eq(7.0).all() and toy.block.a.weight.eq(3.0).all()


def test_generate_under_an_evicting_limit_gives_the_plain_model_s_tokens(pretrained):
    """One rank, ``generate()`` in ``validation_step`` with every chunk gathered for its module alone (an evaluation
    without a training trace): greedy tokens equal to the plain model's. Two ranks: tests/hf/test_two_ranks.py."""
    from transformers import AutoModelForCausalLM

    from tests.hf.models import generating

    model = generating(None)(pretrained=str(pretrained["llama"]))
    strategy = ChunkOffloadStrategy(device_memory_limit=LIMITS["llama"], memory=MemoryOptions(chunk_numel=16384))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, limit_val_batches=2)
    trainer.validate(model, Batches(), verbose=False)
    plain = AutoModelForCausalLM.from_pretrained(pretrained["llama"]).eval()
    assert len(model.generated) == 2 and strategy.memory_stats()["evictions"] > 0
    for prompt, n, got in model.generated:
        want = plain.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want) and got.shape[1] == 8 + n


FIT_WITHOUT_TRANSFORMERS = """
import sys
import lightning as L
import torch
from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.hf_weights import pretrained_class
from tests.models import ParityNet, quiet_trainer, token_data

import transformers  # its lazy top module alone, as import lightning loads it where transformers is installed

assert "transformers.modeling_utils" not in sys.modules
quiet_trainer(strategy=ChunkOffloadStrategy(), max_steps=2).fit(ParityNet(), token_data(8))
print("LOADED", "transformers.modeling_utils" in sys.modules, pretrained_class())
"""


@pytest.mark.slow  # a process of its own
def test_a_fit_of_a_model_without_transformers_does_not_load_its_modelling_code():
    """Where transformers was installed (as the ``hf`` and ``test`` extras install it), ``import lightning`` put its
    lazy top module in ``sys.modules``, and the strategy's check for a ``PreTrainedModel`` at teardown (and at set-up
    on several ranks: [Note: generation on several ranks]) then imported ``transformers.modeling_utils``: 0.4 of the
    0.9 s a tiny fit took, in every process. A ``PreTrainedModel`` can exist only once that module is loaded."""
    import subprocess

    from transformers import PreTrainedModel

    from lightning_chunk.hf_weights import pretrained_class

    out = subprocess.run([sys.executable, "-c", FIT_WITHOUT_TRANSFORMERS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED False None" in out.stdout, out.stdout[-2000:]
    assert pretrained_class() is PreTrainedModel  # loaded here: a transformers model is found as before
