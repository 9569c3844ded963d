"""The ``dattri-llm`` command line: plan, capture, fit, attribute, top-k and report.

The top layer of the package: it imports the attribution and gradient tiers,
and nothing imports it (``import dattri_llm`` does not load it). It needs the
``cli`` extra (``transformers``, ``datasets``, ``pyyaml``).
"""

from dattri_llm.cli.main import main

__all__ = ["main"]
