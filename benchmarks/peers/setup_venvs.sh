#!/usr/bin/env bash
# One venv per peer trainer under $PEERS (default ~/.cache/headway/peers), CPU torch first: a bare
# torch requirement (or torchvision / torchaudio, which speculators lists) resolves to a CUDA build.
# Usage: benchmarks/peers/setup_venvs.sh [speculators|modelopt|specforge ...]   (default: all three)
set -euo pipefail
PEERS=${PEERS:-$HOME/.cache/headway/peers}
PY=${PYTHON:-python3.11}
TORCH=${TORCH_SPEC:-torch==2.13.0}
mkdir -p "$PEERS"

venv() {  # venv NAME -> creates $PEERS/NAME with CPU torch
  local v="$PEERS/$1"
  [ -x "$v/bin/python" ] || "$PY" -m venv "$v"
  "$v/bin/python" -c "import torch" 2>/dev/null || "$v/bin/pip" install -q "$TORCH"
}

speculators() {
  venv speculators
  local p="$PEERS/speculators/bin/pip"
  # --no-deps: its metadata asks for torchvision / torchaudio (CUDA torch); the rest is pure Python
  "$p" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
  "$p" install -q aiohttp click "datasets>=4,<=5.1" httpx huggingface-hub "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" \
    "openai>=2" protobuf psutil "pydantic>=2" "pydantic-settings>=2" rich safetensors "tqdm<=4.70.1" \
    "transformers>=5,<=5.19" "typer>=0.12" accelerate
}

modelopt() {
  venv modelopt
  "$PEERS/modelopt/bin/pip" install -q nvidia-modelopt==0.47.0 "transformers>=4.57,<5.15" accelerate datasets requests
}

specforge() {
  venv specforge
  local p="$PEERS/specforge/bin/pip"
  # --no-deps: it pins torch 2.11 and sglang (a GPU server, used only to capture hidden states online)
  "$p" install -q --no-deps specforge==0.2.0
  "$p" install -q transformers==5.8.1 accelerate datasets tqdm huggingface-hub numpy pydantic psutil pyyaml \
    safetensors requests typing-extensions
}

for peer in "${@:-speculators modelopt specforge}"; do
  for p in $peer; do echo "== $p"; "$p"; done
done
