"""STRIDE: attribution by sparse recovery from learned subset perturbations (``docs/stride.md``).

``design.py`` the subset design, ``operators.py`` the steering operators and
the measurement, ``fit.py`` the operator fit, ``lasso.py`` the batched
Lasso, ``persistence.py`` the fit files, ``config.py`` the settings and
``attributor.py`` the :class:`StrideAttributor` over them.
"""

from dattri_llm.attribution.algorithm.stride.attributor import StrideAttributor
from dattri_llm.attribution.algorithm.stride.config import StrideConfig
from dattri_llm.attribution.algorithm.stride.design import SubsetDesign
from dattri_llm.attribution.algorithm.stride.fit import StrideFit
from dattri_llm.attribution.algorithm.stride.lasso import LassoResult, lasso_fista

__all__ = [
    "LassoResult",
    "StrideAttributor",
    "StrideConfig",
    "StrideFit",
    "SubsetDesign",
    "lasso_fista",
]
