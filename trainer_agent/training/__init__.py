"""The torch training backend: GRPO updates (:mod:`.grpo`), a verifiable toy task (:mod:`.task`) and a
local sampler to drive both without replicas (:mod:`.local_rollout`)."""
