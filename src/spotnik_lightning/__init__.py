"""spotnik-lightning: data-parallel PyTorch training that repairs its all-reduce ring in place.

Importing the package registers the ``spotnik`` torch.distributed backend (CPU), so
``dist.init_process_group("spotnik")`` and ``DistributedDataParallel`` run on the ring.
"""

from spotnik_lightning.api import (
    BackendConnectionError,
    ConfigError,
    EpochFencedError,
    FencedOut,
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

__all__ = [
    "BackendConnectionError", "ConfigError", "EpochFencedError", "FencedOut", "Member", "Membership",
    "MembershipChanged", "MembershipEvent", "MembershipStore", "MembershipTimeoutError", "ProtocolError",
    "RingBrokenError", "RingGroup", "RingTimeouts", "SpotnikError", "open_store",
]
