"""Random Llama models for the engine demo, tests and benchmark (needs
torch and transformers; not imported by ``zkv.testing``): nothing is
downloaded (these machines reach no model hub), weights come from a seed.

``initializer_range=0.2``: the default 0.02 makes a random model repeat one
token, which would hide a wrong KV block behind a constant output."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from ..rank.memory.dtypes import TORCH_DTYPES
from ..wire.vocab import Dtype

#: name -> LlamaConfig arguments
CONFIGS: dict[str, dict[str, Any]] = {
    # the CI model: 4 layers, hidden 256, 8 heads, 4 KV heads (2.9 M parameters)
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 1024,
    },
    # the benchmark model (27.7 M parameters), conversations up to 4k tokens
    "bench": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
        "vocab_size": 4000,
        "max_position_embeddings": 8192,
    },
}


def random_llama(seed: int, dtype: str = Dtype.FP32, config: str = "small") -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(initializer_range=0.2, **CONFIGS[config])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model: Any = transformers.LlamaForCausalLM(cfg)  # Any: mypy reads .to() through transformers' wrappers
    return model.to(TORCH_DTYPES[Dtype(dtype)]).eval()


def load_weights(model: transformers.PreTrainedModel, seed: int, config: str = "small") -> None:
    """Copy the weights of ``random_llama(seed)`` into ``model`` in place (the RL trainer's update)."""
    dtype = next(model.parameters()).dtype
    other: Any = random_llama(seed, Dtype.FP32, config)
    model.load_state_dict(other.to(dtype).state_dict())


def random_tokens(seed: int, n: int, vocab: int = 1000) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def set_threads(n: int) -> int:
    """Set torch's intra-op threads; return the old count."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return old


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
