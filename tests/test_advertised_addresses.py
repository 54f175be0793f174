"""Addresses others connect to: refused when they cannot work (a wildcard, loopback seen from another machine)."""

from __future__ import annotations

import pytest

from mesh_runtime.config import ConfigError, load_config
from mesh_runtime.errors import InvalidArgument
from mesh_runtime.validate import check_reachable
from replica_agent.config import ReplicaAgentConfig
from trainer_agent.config import TrainerAgentConfig


def test_a_wildcard_listen_with_a_controller_needs_an_advertise_address():
    with pytest.raises(ConfigError, match="advertise_address.*required when listen is a wildcard"):
        load_config(ReplicaAgentConfig, None, overrides={"listen": "0.0.0.0:50053", "insecure": True,
                                                         "controller_address": "10.0.0.1:50051"})
    config = load_config(ReplicaAgentConfig, None, overrides={"listen": "0.0.0.0:50053", "insecure": True,
                                                              "controller_address": "10.0.0.1:50051",
                                                              "advertise_address": "10.0.0.3:50053"})
    assert config.advertise_address == "10.0.0.3:50053"


def test_a_wildcard_advertise_address_is_refused():
    with pytest.raises(ConfigError, match="advertise_address.*an address to listen on"):
        load_config(ReplicaAgentConfig, None, overrides={"advertise_address": "0.0.0.0:50053"})


def test_a_registering_balancer_on_a_wildcard_needs_an_advertise_address_and_a_good_id():
    from loadbalancer.config import LoadBalancerConfig  # noqa: PLC0415

    base = {"listen": "0.0.0.0:50052", "insecure": True, "controller_address": "10.0.0.1:50051,10.0.0.2:50051"}
    with pytest.raises(ConfigError, match="advertise_address.*required when listen is a wildcard"):
        load_config(LoadBalancerConfig, None, overrides=base)
    with pytest.raises(ConfigError, match="advertise_address.*an address to listen on"):
        load_config(LoadBalancerConfig, None, overrides={**base, "advertise_address": "[::]:50052"})
    with pytest.raises(ConfigError, match="balancer_id"):
        load_config(LoadBalancerConfig, None, overrides={**base, "advertise_address": "10.0.2.1:50052",
                                                         "balancer_id": "bad id!"})
    config = load_config(LoadBalancerConfig, None, overrides={**base, "advertise_address": "10.0.2.1:50052",
                                                              "balancer_id": "lb-1"})
    assert (config.advertise_address, config.balancer_id) == ("10.0.2.1:50052", "lb-1")
    load_config(LoadBalancerConfig, None, overrides={"listen": "0.0.0.0:50052", "insecure": True})   # no controller


def test_a_trainer_on_a_network_address_cannot_rendezvous_on_loopback():
    with pytest.raises(ConfigError, match="weight_rendezvous.*loopback address, but this trainer serves on"):
        load_config(TrainerAgentConfig, None, overrides={"listen": "10.0.0.5:50054", "insecure": True,
                                                         "weight_rendezvous": "127.0.0.1:29500"})
    load_config(TrainerAgentConfig, None, overrides={"listen": "10.0.0.5:50054", "insecure": True,
                                                     "weight_rendezvous": "10.0.0.5:29500"})


@pytest.mark.parametrize(("address", "peer", "reason"), [
    ("127.0.0.1:50053", "ipv4:10.0.0.3:41000", "LOOPBACK_ADVERTISED"),
    ("[::1]:50053", "ipv6:[fd00::3]:41000", "LOOPBACK_ADVERTISED"),
    ("0.0.0.0:50053", "ipv4:10.0.0.3:41000", "UNREACHABLE_ADDRESS"),
    ("0.0.0.0:50053", "ipv4:127.0.0.1:41000", "UNREACHABLE_ADDRESS"),
])
def test_an_unreachable_advertised_address_is_invalid(address, peer, reason):
    with pytest.raises(InvalidArgument) as err:
        check_reachable(address, peer, "node 'n1'")
    assert err.value.reason == reason and err.value.code == "INVALID_ARGUMENT"
    assert "node 'n1'" in err.value.message and "advertise_address" in err.value.message


@pytest.mark.parametrize(("address", "peer"), [
    ("127.0.0.1:50053", "ipv4:127.0.0.1:41000"),   # all on one machine
    ("10.0.0.3:50053", "ipv4:10.0.0.3:41000"),
    ("10.0.0.3:50053", "ipv4:127.0.0.1:41000"),
    ("node-3.cluster:50053", "ipv4:10.0.0.3:41000"),
    ("127.0.0.1:50053", "unix:/tmp/s"),
])
def test_a_reachable_advertised_address_passes(address, peer):
    check_reachable(address, peer, "node 'n1'")
