"""The text both examples train on, with no download: by default the source files of the Python standard library
of the interpreter running the example, split by file (every 10th file is validation); or any text file or folder.

``read_split`` gives the raw bytes of each split; ``TokenWindows`` serves random windows of ``length`` tokens from a
1-D tensor of token ids; ``WindowsData`` is the data module both examples
build on, with ``tokens(text)`` saying how text becomes ids.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class TokenWindows(Dataset):
    def __init__(self, tokens: torch.Tensor, length: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(tokens) - length, (count,), generator=g)
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        s = int(self.starts[i])
        return self.tokens[s : s + self.length].long()


def text_files(corpus: str | None) -> list[Path]:
    root = Path(corpus) if corpus else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"data.corpus={str(root)!r} is neither a text file nor a folder.")
    pattern = "*.py" if corpus is None else "*"
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)
    if not files:
        raise ValueError(f"data.corpus={str(root)!r} holds no files to read.")
    if corpus is not None and not any(_looks_like_text(f) for f in files[:50]):
        raise ValueError(
            f"data.corpus={str(root)!r} holds no text files (the first {min(len(files), 50)} look binary)."
        )
    return files


def _looks_like_text(path: Path) -> bool:
    head = path.read_bytes()[:4096]
    return bool(head) and b"\0" not in head


def read_split(corpus: str | None, max_bytes: int) -> dict[str, bytes]:
    """Up to ``max_bytes`` of text as ``{"train": ..., "val": ...}``: a deterministic split by file."""
    chunks: dict[str, list[bytes]] = {"train": [], "val": []}
    total = 0
    for i, f in enumerate(text_files(corpus)):
        raw = f.read_bytes()[:max_bytes]
        chunks["val" if i % 10 == 9 else "train"].append(raw)
        total += len(raw)
        if total >= max_bytes:
            break
    if not chunks["val"]:
        chunks["val"].append(chunks["train"][-1])
    return {k: b"".join(v) for k, v in chunks.items()}


def check_enough(split: dict[str, torch.Tensor], length: int, context: int) -> None:
    if min(len(t) for t in split.values()) <= length:
        raise ValueError(
            f"data.corpus holds too little text ({sum(len(t) for t in split.values())} tokens) for a "
            f"context of {context}."
        )


class WindowsData(L.LightningDataModule):
    """Random windows of ``context + extra_tokens`` tokens over the train and validation splits of ``corpus``:
    one more than the context for a model that splits inputs and next-token targets itself (the GPT), none for one
    whose loss shifts the labels (Hugging Face's). Subclasses say how bytes become token ids (``tokens``) and save
    their own hyperparameters (``corpus``, ``context``, ``batch_size``, ``max_bytes``, ``train_windows``,
    ``val_windows``)."""

    extra_tokens = 1

    def tokens(self, text: bytes) -> torch.Tensor:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        split = {k: self.tokens(v) for k, v in read_split(self.hparams.corpus, self.hparams.max_bytes).items()}
        length = self.hparams.context + self.extra_tokens
        check_enough(split, length, self.hparams.context)
        self.train_set = TokenWindows(split["train"], length, self.hparams.train_windows, seed=0)
        self.val_set = TokenWindows(split["val"], length, self.hparams.val_windows, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size * 4)
