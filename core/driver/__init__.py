"""The driver: continuous batching over any Engine, and the LLM API."""

from polyengine.driver.async_llm import AsyncLLM, AsyncRequest
from polyengine.driver.llm import LLM
from polyengine.driver.outputs import Completion, CompletionOutput, StreamDelta, Usage
from polyengine.driver.scheduler import Request, Scheduler

__all__ = ["LLM", "AsyncLLM", "AsyncRequest", "Completion", "CompletionOutput", "StreamDelta", "Usage", "Request", "Scheduler"]
