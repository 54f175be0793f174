"""The rollmesh load balancer: routes generation requests to engine replicas."""
