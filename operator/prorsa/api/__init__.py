"""The RolloutCluster API: pydantic models of spec and status, the single source of truth
from which the CRD (`prorsa crd`) and the configuration reference are generated."""
