"""The "prompt_cache" component: build the PromptBuilder and pin its stable prefix."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prefixrag.app.core.errors import NotReadyError
from prefixrag.app.prompt.builder import PromptBuilder, load_prompt_config

if TYPE_CHECKING:
    from prefixrag.app.state import AppState

logger = logging.getLogger(__name__)


def load_prompt_cache(state: AppState) -> str | None:
    """Component loader (after "llm"): the prompt builder on the model's tokenizer, with the
    stable first part computed once and pinned so it is never evicted."""
    state.require("llm")
    if state.llm is None:
        raise NotReadyError("the LLM must load before the prompt cache")
    config = load_prompt_config(state.settings.system_prompt_file)
    builder = PromptBuilder(state.llm.engine.tokenizer, config)
    state.prompts = builder
    if not state.settings.prefix_cache:
        return "unavailable: prefix cache is off; the stable prompt is prefilled per request"
    num_pinned = asyncio.run(state.llm.engine.pin_prefix(builder.stable_ids))
    logger.info(
        "prompt_cache: stable prefix of %d tokens, %d pinned", len(builder.stable_ids), num_pinned
    )
    return None
