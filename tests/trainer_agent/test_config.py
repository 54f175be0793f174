"""TrainerAgentConfig: defaults load, bad values are refused with a message naming the key."""

from __future__ import annotations

import pytest

from mesh_runtime.config import ConfigError, load_config
from trainer_agent.config import TrainerAgentConfig

pytestmark = pytest.mark.timeout(30)


def test_defaults_and_a_nested_weight_transfer_section():
    config = load_config(TrainerAgentConfig, overrides={"weight_transfer": {"gloo_interface": "lo"}})
    assert config.weight_rendezvous == "127.0.0.1:0"
    assert config.weight_transfer.gloo_interface == "lo"
    assert config.weight_transfer.bucket_size_bytes == 16 << 20


@pytest.mark.parametrize("overrides, key, fragment", [
    ({"model": "no-such-preset"}, "model", "unknown preset"),
    ({"model": "./missing/dir"}, "model", "config.json"),
    ({"weight_rendezvous": "127.0.0.1"}, "weight_rendezvous", "HOST:PORT"),
    ({"weight_rendezvous": "0.0.0.0:0"}, "weight_rendezvous", "reach"),
    ({"weight_dtype": "int8"}, "weight_dtype", "float32"),
    ({"device": "tpu"}, "device", "cpu, cuda"),
    ({"initial_weight_version": -1}, "initial_weight_version", ">= 0"),
    ({"weight_transfer_timeout_s": 0}, "weight_transfer_timeout_s", "> 0"),
    ({"weight_transfer": {"bucket_size_bytes": 0}}, "weight_transfer.bucket_size_bytes", "positive"),
    ({"weight_transfer": {"bucket_size": 1}}, "weight_transfer.bucket_size", "did you mean"),
    ({"training_backend": "jax"}, "training_backend", "torch"),
])
def test_bad_values_name_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(TrainerAgentConfig, overrides=overrides)
    assert info.value.key == key
    assert fragment in str(info.value)
