#!/usr/bin/env bash
# Set up and run the main job on its embedded default, then show where the policies part.
#  1. For real on this machine: a private Redis, two vLLM workers on the CPU (a tiny generated
#     model, NIXL KV transfer), the PD router and the controller drive a seeded coding-agent
#     rollout under PD colocation and under Prorsa's predictive allocation.
#  2. Simulated where PD allocation matters: DeepSeek-V3 on 128 H200 (expert-parallel engines,
#     prefill EP8 / decode EP32), the same kind of rollout under every policy.
# Each writes its run as JSON and as a picture (roles over time, demand vs capacity,
# trajectory completion per policy) under .prorsa/demo/. Extra flags go to `prorsa local`
# (e.g. --workload shift --trajectories 48, or --model DIR for a model of your own).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh worker-cpu
out=.prorsa/demo
mkdir -p "$out"

echo
echo "==> 1/2 for real: 2 vLLM workers on this CPU, colocated vs predictive"
.venv/bin/prorsa local --compare colocated,predictive --workload swe --trajectories 24 \
  --json "$out/local.json" --plot "$out/local.png" "$@"

echo
echo "==> 2/2 simulated: DeepSeek-V3 on 128 H200, expert-parallel engines, every policy (~2 min)"
.venv/bin/prorsa simulate --preset h200-deepseek-v3 --gpus 128 --workload swe --mode sync \
  --policy all --horizon 900 --interval 15 --initial-prefill 1 \
  --json "$out/simulated.json" --plot "$out/simulated.png"

echo
echo "pictures: $out/local.png (this machine) and $out/simulated.png (128 H200)"
echo "On two CPU workers with a tiny model every policy does about the same: there is no"
echo "expert-parallel lockstep for a prefill to stall and no KV pressure. On the simulated"
echo "DeepSeek-V3 cluster a prefill on one rank stalls a whole EP32 decode engine, so moving"
echo "capacity between roles shortens the rollout (the table above; README: Expert-parallel units)."
