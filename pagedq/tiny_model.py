"""Random-weight Hugging Face checkpoints with a locally trained tokenizer, for tests and
benchmarks: nothing is downloaded.

`make_tiny_model(dir)` writes config.json + model.safetensors (saved by transformers' own
model class) and a byte-level BPE tokenizer whose vocabulary covers every model token id,
so any UTF-8 text round-trips and any sampled id decodes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pagedq.model_info import ARCHITECTURE_BY_MODEL_TYPE

TINY_ARCHS = tuple(ARCHITECTURE_BY_MODEL_TYPE)
DTYPES = ("float32", "bfloat16", "float16")

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
_BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# A plain role-tagged format; the bos token is written by the template (the tokenizer
# never adds one), so rendering then tokenizing gives one bos either way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """Architecture-neutral sizes; `config_kwargs` spells them per architecture."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 1024

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.hidden_size % (2 * self.num_heads):
            raise ValueError(f"hidden_size ({self.hidden_size}) must split into num_heads ({self.num_heads}) heads of even size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def config_kwargs(self, arch: str) -> dict:
        if arch == "gpt2":
            if self.num_kv_heads != self.num_heads:
                raise ValueError("num_kv_heads: GPT-2 has no grouped KV heads; leave it equal to num_heads")
            return dict(
                vocab_size=self.vocab_size, n_embd=self.hidden_size, n_layer=self.num_layers,
                n_head=self.num_heads, n_inner=self.intermediate_size, n_positions=self.max_position_embeddings,
            )
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=self.max_position_embeddings,
            head_dim=self.hidden_size // self.num_heads,
        )


# With hidden size 64 and transformers' default init (std 0.02), attention scores are so
# small that attention is nearly uniform and tests could not tell a wrong scale or mask
# from a right one; a larger std gives peaked attention and well-separated logits.
TINY_INIT = {"initializer_range": 0.1}


def tiny_shape(arch: str) -> Shape:
    return Shape(num_kv_heads=Shape.num_heads) if arch == "gpt2" else Shape()


@dataclass(frozen=True)
class Preset:
    arch: str
    shape: Shape
    dtype: str
    extra_config: dict = field(default_factory=dict)


PRESETS = {
    # The CPU benchmark model of shared/notes/benchmarks.md (~56M parameters).
    "bench-56m": Preset(
        "llama",
        Shape(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
              intermediate_size=1408, max_position_embeddings=4096),
        "float32",
    ),
    # Compute so small that a step's time is the host's own (`pagedq bench host`, and
    # `bench offline` against vLLM); head size 64, which vLLM's CPU attention supports.
    "host-bench": Preset(
        "llama",
        Shape(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
              intermediate_size=256, max_position_embeddings=2048),
        "float32",
    ),
    # Real model shapes with random weights, for GPU benchmarks.
    "qwen2.5-0.5b": Preset(
        "qwen2",
        Shape(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
              intermediate_size=4864, max_position_embeddings=32768),
        "bfloat16",
        dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    ),
    "llama-3.2-1b": Preset(
        "llama",
        Shape(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
              intermediate_size=8192, max_position_embeddings=131072),
        "bfloat16",
        dict(
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192),
        ),
    ),
}


def make_tiny_model(
    out_dir: str | Path,
    arch: str | None = None,
    *,
    preset: str | None = None,
    seed: int = 0,
    dtype: str | None = None,
    max_shard_size: str | None = None,
    **config_overrides,
) -> Path:
    """Write a random-weight checkpoint and its tokenizer to `out_dir`; returns the path.

    arch: one of TINY_ARCHS (default "llama", or the preset's). preset: one of PRESETS.
    dtype: the saved weights' dtype (default float32, or the preset's). max_shard_size:
    e.g. "200KB" to write a sharded checkpoint. config_overrides: keyword arguments of the
    architecture's transformers config class, as it spells them (e.g. `num_hidden_layers`
    for llama, `n_layer` for gpt2, `tie_word_embeddings`, `rope_scaling`).
    """
    import torch
    import transformers

    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    chosen = PRESETS.get(preset)
    if arch is not None and chosen is not None and arch != chosen.arch:
        raise ValueError(f"arch: preset {preset!r} is a {chosen.arch} model, got arch={arch!r}")
    arch = arch or (chosen.arch if chosen else "llama")
    if arch not in ARCHITECTURE_BY_MODEL_TYPE:
        raise ValueError(f"arch must be one of {TINY_ARCHS}, got {arch!r}")
    dtype = dtype or (chosen.dtype if chosen else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")

    kwargs = (chosen.shape if chosen else tiny_shape(arch)).config_kwargs(arch)
    kwargs.update(chosen.extra_config if chosen else TINY_INIT)
    kwargs.update(config_overrides)
    model_class = getattr(transformers, ARCHITECTURE_BY_MODEL_TYPE[arch])
    config = model_class.config_class(
        **kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2, architectures=[ARCHITECTURE_BY_MODEL_TYPE[arch]]
    )
    if config.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} for a byte-level tokenizer, got {config.vocab_size}")

    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype))
    _perturb_vectors(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    make_tokenizer(config.vocab_size, _context_length(config)).save_pretrained(out)
    return out


def _perturb_vectors(model, seed: int) -> None:
    """Transformers initialises biases to 0 and norm weights to 1; give every 1-D tensor
    small random offsets so a model that ignored a bias or a norm weight could not match."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                noise = torch.randn(param.shape, generator=generator) * 0.05
                param.add_(noise.to(param.dtype))


def _context_length(config) -> int:
    return getattr(config, "max_position_embeddings", None) or config.n_positions


def make_tokenizer(vocab_size: int, model_max_length: int):
    """A PreTrainedTokenizerFast with exactly `vocab_size` ids (specials first: pad, bos, eos)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        pad_token=PAD, bos_token=BOS, eos_token=EOS,
        # Some model types load with their own tokenizer class (Qwen2Tokenizer), whose default
        # unk token would be a new id past the model's vocabulary.
        unk_token=EOS,
        model_max_length=model_max_length, chat_template=CHAT_TEMPLATE,
    )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"tokenizer training produced {len(tokenizer)} ids, expected {vocab_size}")
    return tokenizer


@lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab_size), trainer)
    return tokenizer.to_str()


def _corpus(vocab_size: int, lines: int = 200):
    """Random words: twice as many distinct words as merges needed, so training always
    reaches `vocab_size` (each distinct word can end as one token)."""
    rng = random.Random(vocab_size)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'-"
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(2 * vocab_size)]
    words_per_line = max(1, 4 * len(words) // lines)
    for _ in range(lines):
        yield " ".join(rng.choices(words, k=words_per_line))
