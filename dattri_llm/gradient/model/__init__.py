"""The gradient data model: payload records, the ``Gradient`` container, low-rank records.

Public paths: :mod:`dattri_llm.gradient.gradient` and :mod:`dattri_llm.gradient.lowrank`.
This package ``__init__`` imports nothing, so the ``ops`` kernels can import
:mod:`~dattri_llm.gradient.model.records` without loading the container (which imports them).
"""
