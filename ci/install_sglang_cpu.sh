#!/usr/bin/env bash
# Create a virtual environment with SGLang 0.5.15.post1 for a CPU-only host, for the sglang
# engine's real-engine runs (offline sglang.Engine and the served /generate API).
#
# Usage: ci/install_sglang_cpu.sh [VENV_DIR]   (default: /work/venv-sglang, or $SGLANG_VENV)
#        ci/install_sglang_cpu.sh --current   (into the running Python's environment: CI runners,
#                                              ci/workflows/sglang-cpu.yml; nothing is created)
#
# Why this release: 0.5.15.post1 is the one release that starts on a CPU-only host without
# sgl_kernel (SGLANG_USE_CPU_ENGINE=1, --device cpu); later releases import sgl_kernel's CPU ops
# at start-up, and PyPI has only CUDA builds of sglang-kernel (no source distribution).
# Why its own venv: sglang pins torch 2.11.0 and transformers 5.12.1 exactly.
# Why PyPI's torch 2.11.0 (a CUDA build, most of the 6 GB): sglang imports torchvision, and
# PyPI's torchvision is linked against the CUDA torch; beside a CPU torch it fails to import.
# The CUDA libraries are installed and never used: the host has no GPU.
# sglang itself goes in with --no-deps, then its requirements minus the CUDA-only ones (kernels
# and their compilers that cannot run or build here); nothing on the CPU LoRA path imports them.
# The project goes in with --no-deps (its own requirements are listed below, checked against the
# pins above by `pip check`-like import of each) so that pip never replaces sglang's torch or
# transformers.
# SGLang's LoRA needs pinned host memory on every backend, which a host without an accelerator
# does not have (sgl-project/sglang#31894); the engine plugin applies the shipped workaround
# (lora_conformance/engines/sglang_cpu_workaround/) itself. This script changes no SGLang file.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${SGLANG_VENV:-/work/venv-sglang}}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.15.post1}"
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.26.0}"
TORCHAUDIO_VERSION="${TORCHAUDIO_VERSION:-2.11.0}"

command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ "$VENV" = "--current" ]; then
    PY="$(command -v python)"
    echo "[install_sglang_cpu] into the current environment (python: $($PY --version 2>&1), $PY)"
else
    echo "[install_sglang_cpu] venv: $VENV (python: $($PYTHON --version 2>&1))"
    "$PYTHON" -m venv "$VENV"
    PY="$VENV/bin/python"
fi
PIP=("$PY" -m pip --disable-pip-version-check)

"${PIP[@]}" install --upgrade pip setuptools wheel
"${PIP[@]}" install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
    "torchaudio==$TORCHAUDIO_VERSION"
"${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"

# sglang 0.5.15.post1's Requires-Dist (its wheel's METADATA), minus: cuda-python, flash-attn-4,
# flashinfer_cubin, flashinfer_python, nvidia-cutlass-dsl, nvidia-mathdx, sgl-deep-gemm,
# sglang-kernel, tilelang, apache-tvm-ffi (tilelang's and flashinfer's runtime), quack-kernels,
# tokenspeed_mla, torch_memory_saver (all CUDA-only), torchcodec (video decoding; not on the
# text path) and the arm-only av/decord2. torch/torchvision/torchaudio are above.
"${PIP[@]}" install \
    "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" "torchaudio==$TORCHAUDIO_VERSION" \
    aiohttp "anthropic>=0.20.0" "blobfile==3.0.0" build compressed-tensors datasets distro easydict \
    einops fastapi gguf interegular IPython "kernels>=0.14.1,<0.15" "llguidance>=0.7.11,<0.8.0" \
    "mistral_common>=1.11.5" modelscope msgspec ninja numpy nvidia-ml-py "openai==2.6.1" \
    "openai-harmony==0.0.4" orjson "outlines==0.1.11" packaging partial_json_parser pillow \
    "prometheus-client>=0.20.0" psutil py-spy pybase64 pydantic python-multipart "pyzmq>=25.1.2" \
    requests scipy sentencepiece setproctitle "smg-grpc-servicer>=0.5.0" "soundfile==0.13.1" \
    tiktoken "timm==1.0.16" "torchao==0.17.0" tqdm "transformers==5.12.1" uvicorn uvloop \
    watchfiles "xgrammar==0.2.1" zstandard

# The project, without letting pip touch sglang's pins, then its own requirements and the test
# tools the suites use (pyproject.toml's dependencies and [test] extra; triton comes with torch).
"${PIP[@]}" install --no-deps -e "$REPO"
"${PIP[@]}" install "torch==$TORCH_VERSION" "transformers==5.12.1" "peft>=0.17" "safetensors>=0.4" \
    "tokenizers>=0.20" "filelock>=3.12" "platformdirs>=3" "pytest>=8.4" "hypothesis>=6.100" \
    "regex>=2022.1" "pytest-xdist>=3.5" "pyyaml>=6" "rouge-score>=0.1.2" nltk "cryptography>=42"

# Smoke check: the imports the engine needs must work in the new venv, or the install is useless.
"$PY" - <<'PY'
import torch, transformers, peft, sglang
import sglang.srt.entrypoints.engine  # noqa: F401  (the offline Engine's module)
import lora_conformance.engines.sglang_engine  # noqa: F401
print(f"[install_sglang_cpu] ok: sglang {sglang.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}, "
      f"cuda available: {torch.cuda.is_available()}")
PY
if [ "$VENV" != "--current" ]; then du -sh "$VENV" | sed 's/^/[install_sglang_cpu] size: /'; fi
