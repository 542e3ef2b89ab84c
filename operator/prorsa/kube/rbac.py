"""Every Kubernetes API permission Prorsa uses, in one list.

The Helm chart grants exactly these rules (a test renders the chart and compares), the operator
tests check every request the operator makes against kmock is covered by them, and the router
Role the operator creates per RolloutCluster comes from `ROUTER_RULES`. Nothing else is granted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    api_group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"apiGroups": [self.api_group], "resources": list(self.resources),
                "verbs": list(self.verbs)}  # fmt: skip

    def allows(self, api_group: str, resource: str, verb: str) -> bool:
        return api_group == self.api_group and resource in self.resources and verb in self.verbs


# What the operator itself does, in each namespace it serves (a Role there, or a ClusterRole when
# it watches every namespace). `create` suffices for most children: they are created if missing
# and never updated; pods are also relabelled (patch) and removed on scale-down (delete).
OPERATOR_RULES: tuple[Rule, ...] = (
    # kopf: watch RolloutClusters, keep its handler progress and diff base on them
    Rule("prorsa.io", ("rolloutclusters",), ("get", "list", "watch", "patch")),
    Rule("prorsa.io", ("rolloutclusters/status",), ("patch",)),
    # the workers: created, relabelled and annotated by the switch protocol, removed on scale-down
    Rule("", ("pods",), ("get", "list", "watch", "create", "patch", "delete")),
    # the router, discovery Services, managed Redis and its generated password
    Rule("", ("services", "serviceaccounts"), ("create",)),
    Rule("", ("secrets",), ("get", "create")),
    Rule("apps", ("deployments",), ("create",)),
    # multi-node workers: a LeaderWorkerSet each, listed, created, its role recorded (patch)
    # and removed on scale-down (its controller makes and remakes the pods)
    Rule("leaderworkerset.x-k8s.io", ("leaderworkersets",), ("list", "create", "patch", "delete")),
    # the router's own Role (ROUTER_RULES: granted only because the operator holds them too)
    Rule("rbac.authorization.k8s.io", ("roles", "rolebindings"), ("create",)),
    # Kubernetes Events on the RolloutCluster (kopf.info/warn and the control loop's switches)
    Rule("", ("events",), ("create",)),
)

# kopf peering: replicas of the operator elect one to act (the other replicas wait)
PEERING_RULE_NAMESPACED = Rule("kopf.dev", ("kopfpeerings",), ("list", "watch", "patch"))
PEERING_RULE_CLUSTER = Rule("kopf.dev", ("clusterkopfpeerings",), ("list", "watch", "patch"))

# What each cluster's router does: discover the worker pods (roles, readiness, drain marks).
ROUTER_RULES: tuple[Rule, ...] = (Rule("", ("pods",), ("get", "list", "watch")),)


def operator_rules(clusterwide: bool) -> tuple[Rule, ...]:
    peering = PEERING_RULE_CLUSTER if clusterwide else PEERING_RULE_NAMESPACED
    return (*OPERATOR_RULES, peering)


def allowed(rules: tuple[Rule, ...], api_group: str, resource: str, verb: str) -> bool:
    return any(r.allows(api_group, resource, verb) for r in rules)
