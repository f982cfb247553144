"""Ring group states and the internal interruption signal."""

RUNNING, REPAIRING, JOINING, STARTING, FENCED, LEAVING, CLOSED = (
    "running", "repairing", "joining", "starting", "fenced", "leaving", "closed")


class Interrupted(Exception):  # noqa: N818 - internal signal, not an error for users
    """An op was aborted by a membership change; the caller turns it into MembershipChanged once
    the change is installed."""
