#!/usr/bin/env bash
# Set up and run the main job on its embedded default: simulate one 32-GPU H200 rollout of
# the built-in coding-agent workload under every allocation policy and compare them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
.venv/bin/prorsa simulate --workload swe --mode sync --gpus 32 --policy all --seed 0 \
  --json out/swe.json --plot out/swe.png "$@"
