"""Packaging for the pure-PyTorch Transformer Engine."""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"',
                    Path("transformer_engine/__init__.py").read_text()).group(1)

# The distribution is named as TE's, so that clients which look TE up by its metadata
# (importlib.metadata "transformer-engine", as HF Accelerate does) find this package;
# the version's local label "+pure" says which implementation it is (README).
setup(
    name="transformer_engine",
    version=version,
    description="A pure-PyTorch implementation of Transformer Engine's PyTorch FP8 training "
                "API, with FP8-aware activation checkpointing",
    long_description=Path("README.rst").read_text(),
    long_description_content_type="text/x-rst",
    packages=find_packages(include=["transformer_engine", "transformer_engine.*"]),
    python_requires=">=3.10",
    # torch is not pinned here (the GPU machine has 2.11); CI pins torch==2.13.0 itself.
    install_requires=["torch>=2.11"],
    # tqdm: the progress bar of examples/pytorch/train_gpt.py (whose tests need it too);
    # accelerate: the HF Accelerate client test. Megatron Core, the other client, is not
    # an extra: its releases declare Requires-Python >= 3.12, which no extra can override;
    # qa/make_venv.sh installs it with the test extras from qa/megatron_requirements.txt.
    extras_require={"test": ["pytest>=7", "numpy", "ruff", "packaging", "accelerate==1.16.0",
                             "tqdm==4.70.1"],
                    "plot": ["matplotlib", "tqdm==4.70.1"]},
)
