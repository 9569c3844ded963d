"""The ``dattri-llm`` command line: plan, capture, fit, attribute, top-k and report.

The top layer of the package: it imports the attribution and gradient tiers,
and nothing imports it (``import dattri_llm`` does not load it). It needs the
``transformers`` extra (``transformers``, which brings ``pyyaml``); reading
parquet files and saved datasets also needs ``datasets`` (the ``cli`` extra).
"""

from dattri_llm.cli.main import main

__all__ = ["main"]
