"""torchrun integration: the ``spotnik`` rendezvous handler (entry point group ``torchrun.handlers``).

``torchrun --rdzv-backend=spotnik --rdzv-endpoint=etcd://h:p --nnodes=MIN:MAX train.py`` launches a
job whose survivors are never restarted and whose newcomers join in place (docs/torchrun.md).
Layering: imports membership and ring, never lightning.
"""

from spotnik_lightning.elastic.config import RdzvConfig
from spotnik_lightning.elastic.rendezvous import (
    BACKEND,
    SpotnikRendezvousHandler,
    create_handler,
    fingerprint,
    handler_factory,
)

__all__ = ["BACKEND", "RdzvConfig", "SpotnikRendezvousHandler", "create_handler", "fingerprint", "handler_factory"]
