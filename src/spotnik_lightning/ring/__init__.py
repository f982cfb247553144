"""The self-repairing ring: transport, collectives, repair and join.

:class:`RingGroup` is the one object the layers above use.
"""

from spotnik_lightning.ring.events import MembershipEvent
from spotnik_lightning.ring.group import RingGroup

__all__ = ["MembershipEvent", "RingGroup"]
