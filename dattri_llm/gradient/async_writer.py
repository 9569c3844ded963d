"""Background gradient writer (spec path): re-exports `dattri_llm.gradient.store.async_writer`."""

from __future__ import annotations

from dattri_llm.gradient.store.async_writer import THREAD_NAME as THREAD_NAME
from dattri_llm.gradient.store.async_writer import AsyncGradientWriter

__all__ = ["AsyncGradientWriter"]
