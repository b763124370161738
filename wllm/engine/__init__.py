"""The engine core: paged KV cache with prefix caching, one-budget scheduler, step plan, worker, step
runners, samplers, and the synchronous (`LLMEngine`) and asyncio (`AsyncEngine`) fronts."""

from wllm.engine.async_engine import AsyncEngine, EngineDeadError
from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config_from_kwargs
from wllm.engine.llm_engine import EngineClosedError, LLMEngine
from wllm.engine.request import QueueFullError

__all__ = [
    "AsyncEngine",
    "CacheConfig",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "QueueFullError",
    "SchedulerConfig",
    "engine_config_from_kwargs",
]
