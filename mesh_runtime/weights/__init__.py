"""Weight broadcast from the trainer (or a seed replica) to inference replicas.

Model-running servers only: this package imports torch, and
``mesh_runtime/__init__.py`` must never import it. The pieces:

- :mod:`.manifest` -- which tensors travel, their layout in buckets, the checksum;
- :mod:`.groups` -- gloo/NCCL process groups per member set, cached;
- :mod:`.transfer` -- the pipelined bucket broadcast itself;
- :mod:`.errors` -- what can go wrong, as canonical-code errors.

A sync, as the servers drive it (each call blocks; run it in a thread)::

    cache = GroupCache(self_id, config)                      # once per process
    group = cache.get(group_id, members, rendezvous, "gloo")  # members[0] sends
    # sender:    send_weights(group, manifest, model.named_parameters())
    # receivers: validate_against(manifest, expected_spec)
    #            tensors = receive_weights(group, manifest)
"""

from .errors import (
    ChecksumMismatch,
    GroupBusy,
    GroupClosed,
    InvalidManifest,
    ManifestMismatch,
    PeerLost,
    TransferCancelled,
    TransferTimeout,
    WeightTransferError,
)
from .groups import GroupCache, GroupKey, TransferGroup, WeightTransferConfig
from .manifest import (
    ALIGNMENT,
    CHECKSUM_ALGORITHMS,
    Manifest,
    TensorEntry,
    build_manifest,
    validate_against,
)
from .transfer import (
    TOPOLOGIES,
    SendResult,
    broadcast_manifest,
    receive_weights,
    receive_weights_async,
    send_weights,
    send_weights_async,
)

__all__ = [
    "ALIGNMENT", "CHECKSUM_ALGORITHMS", "TOPOLOGIES",
    "ChecksumMismatch", "GroupBusy", "GroupCache", "GroupClosed", "GroupKey", "InvalidManifest", "Manifest",
    "ManifestMismatch", "PeerLost", "SendResult", "TensorEntry", "TransferCancelled", "TransferGroup",
    "TransferTimeout", "WeightTransferConfig", "WeightTransferError",
    "broadcast_manifest", "build_manifest", "receive_weights", "receive_weights_async",
    "send_weights", "send_weights_async", "validate_against",
]
