"""How full copies of a weight version fan out from the peers that hold it: a tree of chains, one copy into
each node (:meth:`controller.weight_sync.WeightBroadcast` runs the chains).

A chain is one broadcast from a source replica down its members; on gloo each member relays every bucket to
the next, so a source sends one copy however long its chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

NodeOf = Callable[[str], "str | None"]
"""A replica's node (None: not a replica, the trainer)."""


def ranked(replica_ids: Sequence[str], source: str, node_of: NodeOf) -> list[str]:
    """The members of a chain from ``source`` in rank order: on the source's node first, then node by node (the
    chain crosses between nodes once per node), by id within a node."""
    node = {r: node_of(r) or "" for r in replica_ids}
    home = node_of(source)
    return sorted(replica_ids, key=lambda r: (node[r] != home, node[r], r))


def shares(pending: list[str], holders: list[str], node_of: NodeOf, cap: int) -> list[tuple[str, list[str]]]:
    """``pending`` as chains, each from one of ``holders`` (replicas at the version).

    A node's pending replicas stay in one chain, so one copy enters a node and its members relay it on: from
    a holder on that node when there is one, else the nodes are dealt over other holders, the largest first
    to the least loaded, a holder on a node the sources do not yet send from first. At most ``cap`` sources;
    beyond, nodes join the shortest chains.
    """
    node = {r: node_of(r) for r in (*holders, *pending)}
    groups: dict[str | None, list[str]] = {}
    for replica_id in pending:
        groups.setdefault(node[replica_id], []).append(replica_id)
    cap = max(1, cap)
    chains: dict[str, list[str]] = {}
    remote = []
    for where, members in groups.items():
        local = next((h for h in holders if node[h] == where and h not in chains), None)
        if local is not None and len(chains) < cap:
            chains[local] = list(members)
        else:
            remote.append(members)
    while remote and len(chains) < min(cap, len(groups)):
        spare = [h for h in holders if h not in chains]
        if not spare:
            break
        sending = [node[h] for h in chains]
        chains[min(spare, key=lambda h: sending.count(node[h]))] = []   # the first on a node sending least
    for members in sorted(remote, key=len, reverse=True):
        chains[min(chains, key=lambda h: len(chains[h]))] += members
    return [(seed, chain) for seed, chain in chains.items() if chain]
