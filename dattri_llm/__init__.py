"""dattri_llm: training data attribution at LLM scale."""

__version__ = "0.1.0"
