"""Shared by the transformers-cache tests (CPU and GPU): generation through a given cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from witcert.integrations.transformers_cache import cache_kwarg


def greedy_generate(
    model: PreTrainedModel, prompt: torch.Tensor, cache: Cache, max_new_tokens: int, **generation: Any
) -> torch.Tensor:
    """``model.generate`` of an unpadded ``prompt`` through ``cache``, greedy; ``generation``: more generate options."""
    with torch.no_grad():
        return model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **generation,
            **{cache_kwarg(model): cache},
        )
