"""The main job's data: the training text and its byte-level train/validation split
(see train_gpt.py)."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Optional

import torch


def load_text(path: Optional[str], max_bytes: int) -> tuple:
    """The training text and a description of it: a file, every text file under a
    folder (sorted by path), or by default the ``*.py`` sources of the standard
    library of the Python running this, sorted by path; capped at ``max_bytes``."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        what = f"the Python {sys.version.split()[0]} standard library source in {root}"
    else:
        root = Path(path)
        if root.is_file():
            files, what = [root], str(root)
        elif root.is_dir():
            files, what = sorted(p for p in root.rglob("*") if p.is_file()), f"the files under {root}"
        else:
            raise ValueError(f"train_gpt.py: --data {path!r} is neither a file nor a folder")
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:4096]:        # a binary file
            continue
        chunks.append(data)
        total += len(data) + 1
        if total >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    if len(text) < 4096:
        raise ValueError(f"train_gpt.py: only {len(text)} bytes of text in {what}; "
                         "give --data a file or folder with at least 4 KiB of text")
    return text, what


class CharData:
    """Byte tokens (vocabulary 256), split deterministically: the text is cut into
    blocks of ``block`` bytes and every tenth block is validation, the rest training,
    so both splits sample the same mix of files."""

    vocab_size = 256

    def __init__(self, text: bytes, seq_len: int, device: torch.device):
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        block = max(seq_len + 1, min(1 << 16, len(tokens) // 20))
        blocks = tokens.split(block)
        self.train = torch.cat([b for i, b in enumerate(blocks) if i % 10 != 9])
        self.val = torch.cat([b for i, b in enumerate(blocks) if i % 10 == 9])
        if len(self.val) <= seq_len + 1:
            raise ValueError(f"train_gpt.py: the text ({len(text)} bytes) is too short for "
                             f"--seq-len {seq_len}; give more text or a shorter --seq-len")
        self.seq_len, self.device = seq_len, device

    def batch(self, split: str, batch_size: int, generator: torch.Generator):
        """Random windows of ``seq_len + 1`` tokens: inputs and next-token targets."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=generator)
        chunk = data[starts[:, None] + torch.arange(self.seq_len + 1)]
        return chunk[:, :-1].to(self.device), chunk[:, 1:].to(self.device)
