"""transformers' continuous-batching manager with explicit sizes, for
``TransformersCBEngine`` (engine.py), and the transformers version zkv's door
is written against."""

from __future__ import annotations

from typing import Any

import transformers
from transformers.generation.configuration_utils import ContinuousBatchingConfig

PINNED_VERSION = "5.23.0"


def build_manager(
    model: transformers.PreTrainedModel,
    *,
    num_blocks: int,
    block_size: int = 16,
    max_batch_tokens: int = 256,
    prefix_sharing: bool = True,
    max_new_tokens: int = 16,
    eos_token_id: int = -1,
):
    """A continuous-batching manager with explicit sizes (no memory probing picks them) and greedy decoding."""
    if transformers.__version__ != PINNED_VERSION:
        raise RuntimeError(
            f"zkv.engines.transformers is written against transformers=={PINNED_VERSION}, "
            f"found {transformers.__version__}: install zkv[transformers]"
        )
    generation_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id
    )
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks,
        page_size=block_size,
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=prefix_sharing,
        use_cuda_graph=False,
        use_async_batching=False,  # async batching keeps a batch in flight across the pause
        return_logprobs=True,
    )
    # Typed as Any: mypy resolves the attribute through nn.Module.__getattr__ (-> Tensor).
    init: Any = model.init_continuous_batching
    return init(generation_config=generation_config, continuous_batching_config=cb_config)
