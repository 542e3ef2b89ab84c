"""Label and annotation names on the pods Prorsa owns (DESIGN.md contracts)."""

CLUSTER = "prorsa.io/cluster"
COMPONENT = "prorsa.io/component"
ROLE = "prorsa.io/role"
DRAINING = "prorsa.io/draining"
TARGET_ROLE = "prorsa.io/target-role"
PORT = "prorsa.io/port"  # annotation: the worker's vLLM port (default 8000)

WORKER = "worker"
ROUTER = "router"
TRAINER = "trainer"


def worker_selector(cluster: str) -> str:
    return f"{CLUSTER}={cluster},{COMPONENT}={WORKER}"
