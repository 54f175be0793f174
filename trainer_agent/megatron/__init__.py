"""The megatron-core training backend (``training_backend: megatron``)."""
