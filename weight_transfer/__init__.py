"""Weight broadcast from the trainer (or a seed replica) to inference replicas.

Model-running servers only (replica and trainer agents): this package imports torch; the
shared runtime (``mesh_runtime``) never imports it. The names below are loaded on first use, so
the torch-free :mod:`.spec` (``WeightSpec``) imports without torch. The pieces:

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

import importlib
from typing import Any

_EXPORTS = {
    "errors": ("ChecksumMismatch", "DeltaRefused", "GroupBusy", "GroupClosed", "InvalidManifest", "ManifestMismatch", "NotAuthentic",
               "PeerLost", "TransferCancelled", "TransferTimeout", "VerificationFailed", "WeightTransferError"),
    "groups": ("GroupCache", "GroupKey", "TransferGroup", "WeightTransferConfig"),
    "manifest": ("ALIGNMENT", "CHECKSUM_ALGORITHMS", "Manifest", "TensorEntry", "build_manifest", "manifest_tag",
                 "validate_against", "views_of"),
    "transfer": ("TOPOLOGIES", "SendResult", "broadcast_manifest", "receive_weights", "receive_weights_async",
                 "send_weights", "send_weights_async"),
    "spec": ("WeightSpec",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'weight_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
