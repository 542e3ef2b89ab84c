"""Label and annotation names on the pods Prorsa owns (DESIGN.md contracts)."""

CLUSTER = "prorsa.io/cluster"
COMPONENT = "prorsa.io/component"
ROLE = "prorsa.io/role"
DRAINING = "prorsa.io/draining"
TARGET_ROLE = "prorsa.io/target-role"
PORT = "prorsa.io/port"  # annotation: the worker's vLLM port (default 8000)
WORKER_INDEX = "prorsa.io/worker-index"  # a worker's index in its cluster (its name's suffix)
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"  # on the pods of a LeaderWorkerSet (its name)
LWS_NODE = "leaderworkerset.sigs.k8s.io/worker-index"  # a pod's node in its group (leader: 0)
# annotation on a multi-node worker's pods: nodes one engine spans, per role (JSON), where a
# role's engines are narrower than the worker (several side by side, each its own endpoint)
ENGINE_NODES = "prorsa.io/engine-nodes"

WORKER = "worker"  # a worker's pod (a multi-node worker's first node)
WORKER_GROUP = "worker-group"  # the LeaderWorkerSet of a multi-node worker
WORKER_NODE = "worker-node"  # a multi-node worker's other nodes
ROUTER = "router"
TRAINER = "trainer"


def worker_selector(cluster: str) -> str:
    return f"{CLUSTER}={cluster},{COMPONENT}={WORKER}"


def engine_selector(cluster: str) -> str:
    """Pods that may serve an engine (workers and the other nodes of multi-node ones) are
    among the cluster's; an equality selector, which every API server and emulator applies
    alike, and the few others (router, Redis) are skipped by component."""
    return f"{CLUSTER}={cluster}"


def group_selector(cluster: str) -> str:
    return f"{CLUSTER}={cluster},{COMPONENT}={WORKER_GROUP}"
