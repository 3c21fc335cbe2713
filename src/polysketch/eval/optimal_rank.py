"""Re-export of ``polysketch.features.optimal_rank`` (moved there so that the feature maps,
a lower layer, share the one implementation of the Eckart–Young optimum; see ``CHANGELOG.md``).
"""

from ..features.optimal_rank import (  # noqa: F401  (re-exported)
    OptimalError,
    __all__,  # noqa: F401
    check_qk,
    fitted_optima,
    fitted_optimum,
    optimal_curve,
    optimal_rank_approximation,
    optimal_rank_error,
    optimal_rank_error_of,
    polynomial_target,
)
