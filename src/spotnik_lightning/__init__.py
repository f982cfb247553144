"""spotnik-lightning: data-parallel PyTorch training that repairs its all-reduce ring in place.

Importing the package registers ``Trainer(strategy="spotnik")`` with Lightning (as soon as Lightning
is imported, so ring-only processes do not pay for importing it) and the ``spotnik``
torch.distributed backend (CPU), so ``dist.init_process_group("spotnik")`` and
``DistributedDataParallel`` run on the ring.
"""

from typing import Any

from spotnik_lightning._register import install as _install_strategy
from spotnik_lightning.api import (
    BackendConnectionError,
    ConfigError,
    EpochFencedError,
    FencedOut,
    FetchError,
    MembershipChanged,
    MembershipTimeoutError,
    ProtocolError,
    RingBrokenError,
    RingTimeouts,
    SpotnikError,
)
from spotnik_lightning.membership import Member, Membership, MembershipStore, open_store
from spotnik_lightning.ring import MembershipEvent, RingGroup
from spotnik_lightning.ring.backend import register as _register_backend

__version__ = "0.1.0"

_register_backend()
_install_strategy()


def __getattr__(name: str) -> Any:
    if name == "SpotnikStrategy":  # imports Lightning: only when asked for
        from spotnik_lightning.lightning.strategy import SpotnikStrategy

        return SpotnikStrategy
    raise AttributeError(f"module 'spotnik_lightning' has no attribute {name!r}")


__all__ = [
    "BackendConnectionError", "ConfigError", "EpochFencedError", "FencedOut", "FetchError", "Member", "Membership",
    "MembershipChanged", "MembershipEvent", "MembershipStore", "MembershipTimeoutError", "ProtocolError",
    "RingBrokenError", "RingGroup", "RingTimeouts", "SpotnikError", "SpotnikStrategy", "open_store",
]
