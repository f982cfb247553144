"""Lightning integration: :class:`SpotnikStrategy` and its elastic data, commit protocol and state transfer.

Importing this package imports only the light parts; ``SpotnikStrategy`` (which imports Lightning)
lives in :mod:`spotnik_lightning.lightning.strategy`.
"""

from spotnik_lightning.lightning.data import ElasticCursor, StepPlan, linear_lr_scale

__all__ = ["ElasticCursor", "StepPlan", "linear_lr_scale"]
