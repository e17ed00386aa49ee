"""Shared fixtures. The real model is prepared by `make test` (or on first use here)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_tiny

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():
    # Triton kernels run through its interpreter on CPU tensors (correctness only). Must be set
    # before any @triton.jit function is created.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        try:
            from runtime.triton_interpreter import make_dots_row_independent
            make_dots_row_independent()     # a row's dot not depending on the host's BLAS
        except ImportError:                 # no triton: its tests skip
            pass


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, fp32, HF format (prepared once into the models home)."""
    from dflash.prepare.smollm2 import prepare_smollm2
    return prepare_smollm2(["float32"], progress=False)["float32"]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir):
    """transformers' greedy generate on SmolLM2 (support.gateway_stack.GreedyReference), loaded
    once for every test file that checks output against it."""
    from support.gateway_stack import GreedyReference
    return GreedyReference(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_02_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose weights are large enough (init range 0.2) that its greedy path does
    not just repeat one token (the verify tests)."""
    return make_tiny(tmp_path_factory.mktemp("tiny_llama_02"), "llama", initializer_range=0.2,
                     tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_02_drafter(tiny_llama_02_dir, tmp_path_factory) -> Path:
    """A DFlash drafter with random weights for tiny_llama_02 (block 8): the feature-plane and
    draft-ahead tests, which compare drafts, not their quality."""
    from dflash.make_draft import make_random_drafter
    return make_random_drafter(tiny_llama_02_dir, tmp_path_factory.mktemp("tiny_llama_02_drafter"),
                               block_size=8)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", head_dim=32,
                     tie_word_embeddings=False)


@pytest.fixture
def log_dir(tmp_path) -> Path:
    return tmp_path
