#!/usr/bin/env bash
# Set up and run the main job on its embedded default: the whole system on this machine —
# a private Redis, two real vLLM workers on the CPU (a tiny generated model, NIXL KV transfer),
# the PD router and the controller — driving a seeded coding-agent rollout under PD colocation
# and under Prorsa's predictive allocation, then comparing them. Extra flags go to
# `prorsa local` (e.g. --workload shift --trajectories 48).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh worker-cpu
.venv/bin/prorsa local --compare colocated,predictive --workload swe --trajectories 24 "$@"
