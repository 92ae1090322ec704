"""Tiny random-weight models (one per supported family) and a character tokenizer with a
chat template, all built offline from configs in well under a second."""

from __future__ import annotations

import string
from typing import Any

import torch
import transformers as tf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from abstain_guard.adapters import GeometryChatModel

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
CONTEXT = 96

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FAMILIES = (
    "llama",
    "qwen2",
    "mistral",
    "gemma3_text",
    "gpt2",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "gemma2",
    "phi3",
    "olmo2",
    "granite",
    "gpt_oss",
)

#: Families whose attention sdpa cannot compute (logit soft-capping, attention sinks).
EAGER_FAMILIES = ("gemma2", "gpt_oss")


def _llama_like(**changes: Any) -> dict[str, Any]:
    """Tiny sizes shared by the Llama-like families: 3 layers, hidden 32, 4 query / 2 KV
    heads, context :data:`CONTEXT` (read at call time: tests may patch it)."""
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": False,
        **changes,
    }


def char_tokenizer() -> Any:
    """A character-level fast tokenizer (ids: 0 pad, 1 <|im_start|>, 2 <|im_end|> = EOS)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<unk>",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(family: str) -> Any:
    """A config with 3 layers, hidden 32, 4 query heads (2 KV heads where supported)."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "llama":
        return tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
            attention_bias=True,  # exercises value bias (in parts) and o_proj bias (total only)
            tie_word_embeddings=False,
            **common,
        )
    if family == "qwen2":
        return tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
            tie_word_embeddings=False,
            **common,
        )
    if family == "mistral":
        return tf.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=CONTEXT,
            sliding_window=12,  # shorter than the sequences of the tests
            tie_word_embeddings=False,
            **common,
        )
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            max_position_embeddings=CONTEXT,
            sliding_window=10,  # shorter than the sequences of the tests
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
    if family == "qwen3":  # QK-norm (per head), explicit head_dim != hidden / heads
        return tf.Qwen3Config(**_llama_like(head_dim=16), **common)
    if family == "qwen3_moe":  # QK-norm; layer 1 dense (mlp_only_layers), others 4 experts
        return tf.Qwen3MoeConfig(
            **_llama_like(head_dim=8),
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            **common,
        )
    if family == "smollm3":  # layer 1 has no RoPE (NoPE)
        return tf.SmolLM3Config(**_llama_like(), no_rope_layers=[1, 0, 1], **common)
    if family == "gemma2":  # sandwich norms, attention and final logit soft-capping
        return tf.Gemma2Config(
            **_llama_like(tie_word_embeddings=True),
            head_dim=8,
            query_pre_attn_scalar=8,
            attn_logit_softcapping=2.0,  # small enough that tanh bends the random scores
            final_logit_softcapping=3.0,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
    if family == "phi3":  # fused qkv_proj and gate_up_proj, partial rotary, sliding window
        return tf.Phi3Config(
            **_llama_like(num_key_value_heads=1),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            sliding_window=12,  # as Phi-3-mini's 2,047, shorter than the sequences
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            **common,
        )
    if family == "olmo2":  # no pre-norms; post-attention / post-MLP norms; QK-norm
        return tf.Olmo2Config(**_llama_like(), **common)
    if family == "granite":  # embedding / attention / residual multipliers, logit scaling
        return tf.GraniteConfig(
            **_llama_like(),
            embedding_multiplier=3.0,
            attention_multiplier=0.5,
            residual_multiplier=0.6,
            logits_scaling=2.0,
            **common,
        )
    if family == "gpt_oss":  # attention sinks, sliding windows, MoE MLP
        return tf.GptOssConfig(
            **_llama_like(head_dim=8),
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    if family == "gpt2":
        return tf.GPT2Config(
            n_embd=32,
            n_layer=3,
            n_head=4,
            n_positions=CONTEXT,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def tiny_hf_model(
    family: str,
    seed: int = 0,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A random-weight causal LM of ``family`` with weights large enough that the attention
    is far from uniform (std 0.3 for matrices, 1 +- 0.3 for norm scales, 1 +- 0.3 for
    gpt-oss's sink logits), drawn in float32 and then cast to ``dtype``.
    ``attn_implementation``: default ``sdpa``, ``eager`` where sdpa cannot run."""
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    if attn_implementation is None:
        attn_implementation = "eager" if family in EAGER_FAMILIES else "sdpa"
    model = tf.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=attn_implementation
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.3
            if name.endswith("sinks"):
                p.copy_(1.0 + noise)  # logits comparable to the scores: the sink takes mass
            elif "norm" in name or name.split(".")[-2].startswith("ln"):
                if family in ("gemma3_text", "gemma2"):
                    p.copy_(noise)  # Gemma scales by (1 + w)
                elif name.endswith("weight"):
                    p.copy_(1.0 + noise)
                else:
                    p.copy_(noise)
            else:
                p.copy_(noise)
        if family == "gpt_oss":  # EOS logit 0: seed 3's answer would end after 3 tokens
            model.lm_head.weight[cfg.eos_token_id] = 0.0
    return model.to(dtype).eval()


def tiny_chat_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **options: Any
) -> GeometryChatModel:
    """A GeometryChatModel around :func:`tiny_hf_model` and :func:`char_tokenizer`."""
    options.setdefault("model_name", f"tiny-{family}")
    hf = tiny_hf_model(family, seed, dtype=dtype)
    return GeometryChatModel.from_hf(hf, char_tokenizer(), **options)


#: Prompts of different lengths for concurrent callers of a tiny chat model.
CONCURRENT_PROMPTS = [
    "Hi",
    "A much longer question about capitals, rivers and mountains?",
    "Third one",
    "x",
    "What is the boiling point of water?",
    "Name a prime number.",
]


def assert_same_answer(a: Any, b: Any) -> None:
    """Bitwise equality of two answers (text, tokens, logprobs, entropy, geometry)."""
    ma, mb = a.response_metadata, b.response_metadata
    assert a.content == b.content
    for key in ("token_ids", "logprobs", "entropy", "geometry", "finish_reason"):
        assert ma.get(key) == mb.get(key), key
