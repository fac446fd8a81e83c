"""The adaptive draft budget: the policy (``policy.py``), the step-cost model (``cost_model.py``) and
the start-up probe that seeds it (``cost_probe.py``)."""

from .cost_model import CostModel
from .policy import LOG_EVERY_S, MIN_STEPS, OVERHEAD_WINDOW, TIME_WINDOW, BudgetPolicy, BudgetStats

__all__ = ["LOG_EVERY_S", "MIN_STEPS", "OVERHEAD_WINDOW", "TIME_WINDOW", "BudgetPolicy", "BudgetStats", "CostModel"]
