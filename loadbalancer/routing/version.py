"""Version aware: a replica serves a request only at the weight version it asks for
(``min_weight_version``) and, with ``max_version_lag``, at most that many versions behind the newest
replica in the table."""

from __future__ import annotations

from .policy import Candidate, Pick


class VersionFloor:
    """See the module docstring."""

    def __init__(self, max_version_lag: int | None) -> None:
        self.max_version_lag = max_version_lag

    def floor(self, min_weight_version: int | None, newest_version: int | None) -> int | None:
        """The lowest version a request may be served at (None: any); ``newest_version`` None: an empty table."""
        floors = []
        if min_weight_version is not None:
            floors.append(min_weight_version)
        if self.max_version_lag is not None and newest_version is not None:
            floors.append(newest_version - self.max_version_lag)
        return max(floors) if floors else None

    def why_not(self, route: Candidate, pick: Pick) -> str:
        floor = self.floor(pick.min_weight_version, pick.newest_version)
        if floor is not None and route.weight_version < floor:
            return f"weight_version {route.weight_version} < required {floor}"
        return ""
