"""`dflash prepare-model smollm2-135m-instruct`: the converted directory checked against
transformers' own loading of the same GGUF (weights, tokenizer, chat template, greedy output).
`smollm2_dir` (conftest) prepares the fp32 directory in the default models home if missing."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from dflash.cli import main
from dflash.prepare import smollm2
from dflash.prepare.smollm2 import fetch_gguf, is_prepared, prepare_smollm2

VARIED = [
    "The capital of France is",
    "Hello, world! How's it going? I'm fine; you'll see.",
    'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\nclass Foo:\n\tpass\n',
    "for (int i = 0; i < 10; ++i) {\n        x[i] = i * 2;\n}\n",
    "I love pizza 🍕🔥👍🏽 and my family 👨‍👩‍👧",
    "北京是中国的首都。你好，世界！",
    "In 2024, 3.14159 × 1,000,000 = 3141590 and -42e-3.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<file_sep>c",
    "Ünïcödé façade naïve — “quotes” ‘single’ …   ",
    "",
]


@pytest.fixture(scope="module")
def gguf(smollm2_dir: Path) -> Path:
    return fetch_gguf(progress=False)


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.slow
def test_transformers_loads_it_and_greedy_says_paris(smollm2_dir: Path, ours: Tokenizer) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.tensor([ours.encode("The capital of France is").ids])
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert ours.decode(out[0, ids.shape[1]:].tolist()).startswith(" Paris")


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loading(smollm2_dir: Path, gguf: Path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    got = load_file(smollm2_dir / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(ref.config, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == ref.config.rope_parameters["rope_theta"]


@pytest.mark.slow
@pytest.mark.parametrize("text", VARIED)
def test_tokenizer_matches_transformers_gguf(ours: Tokenizer, gguf_tokenizer, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == gguf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_tokenizer_splits_digits_like_llama_cpp(ours: Tokenizer, gguf_tokenizer) -> None:
    """Deliberate difference: llama.cpp's `smollm` pre-tokenizer (and SmolLM2's own tokenizer.json)
    splits off every \\p{N} character before the GPT-2 regex; transformers' GGUF loader skips that
    step, which shows when 2+ spaces precede a digit or a space precedes a non-ASCII numeral
    (about 10% of Python source files). The vocabulary, merges and special tokens agree."""
    text = "x =  12\n    if y:  3  # ½ of 2²"
    llama_cpp = Tokenizer.from_str(gguf_tokenizer.backend_tokenizer.to_str())
    llama_cpp.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), llama_cpp.pre_tokenizer])
    assert ours.encode(text).ids == llama_cpp.encode(text).ids
    assert ours.encode(text).tokens[:4] == ["x", "Ġ=", "ĠĠ", "1"]
    assert ours.encode(text).ids != gguf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a prime number."}],
])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(smollm2_dir: Path, ours: Tokenizer, gguf_tokenizer,
                                            messages: list[dict[str, str]],
                                            add_generation_prompt: bool) -> None:
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=config["bos_token"], eos_token=config["eos_token"])
    expected = gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered).ids == gguf_tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.slow
def test_second_prepare_is_a_fast_noop(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat()
    start = time.perf_counter()
    assert prepare_smollm2(["float32"], progress=False) == {"float32": smollm2_dir}
    assert time.perf_counter() - start < 1.0
    after = (smollm2_dir / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_incomplete_directory_is_never_prepared(tmp_path: Path) -> None:
    final = tmp_path / "float32"

    def crash(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        smollm2._build_atomically(final, crash)
    assert not final.exists() and list(tmp_path.iterdir()) == []
    final.mkdir()
    (final / smollm2.MARKER).write_text(json.dumps(
        {"format_version": smollm2.FORMAT_VERSION - 1, "source_sha256": smollm2.GGUF_SHA256}))
    assert not is_prepared(final)  # written by an older converter


def test_unknown_model_exits_2_naming_known_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare-model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "smollm2-135m-instruct" in err
