#!/usr/bin/env bash
# Installs what strata needs to build and test on Debian 12, as root. Idempotent: installs only
# the packages that are missing. The CUDA toolkit is not a Debian package; when it is present
# (/usr/local/cuda) the CUDA backend is built too, else only the host backend.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip python3-venv
  liburing-dev libtbb-dev libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libopenblas-dev
  clang libclang-rt-14-dev
  fio
  e2fsprogs mount  # mkfs.ext4 and losetup: CI's loop-mounted disk where /var/tmp is on none
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install-deps: all ${#packages[@]} packages present"
# The Python side lives in a virtual environment (Debian's own python is externally managed):
# numpy, safetensors and torch for the Python package's tests and the interop examples, pytest,
# nanobind and scikit-build-core to build the binding (strata._core), transformers for
# strata.torch's models and accelerate, the peer bench/hf-vs-accelerate.py compares against. torch is large (about
# 5 GB with its CUDA libraries), so the environment is made once per machine, under
# ~/.cache/strata (or $STRATA_VENV), and the repository's .venv links to it; a .venv that is
# already a real environment is used as it is. Tests run with .venv/bin/python (CMake's
# STRATA_PYTHON), so a failed install here fails the test run instead of skipping it.
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -d "$root/.venv" ] && [ ! -L "$root/.venv" ]; then
  venv=$root/.venv
else
  venv=${STRATA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/venv-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
  mkdir -p "$(dirname "$venv")"
  ln -sfn "$venv" "$root/.venv"
fi
python_packages=(numpy safetensors pytest nanobind scikit-build-core torch transformers accelerate)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || { echo "install-deps: python3 -m venv $venv failed" >&2; exit 1; }
fi
if ! "$venv/bin/python" -c "import numpy, safetensors, pytest, nanobind, scikit_build_core, torch, transformers, accelerate" 2>/dev/null; then
  echo "install-deps: installing ${python_packages[*]} into $venv (torch takes minutes, once)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${python_packages[@]}" ||
    { echo "install-deps: pip install ${python_packages[*]} into $venv failed" >&2; exit 1; }
fi
echo "install-deps: $venv has ${python_packages[*]}"
# DeepSpeed, only for the benchmarks that compare against it (bench/optim-vs-torch.py,
# bench/deepspeed-aio-vs-strata.sh); they say so when it is missing, so a failure here warns.
if ! "$venv/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check deepspeed ||
    echo "install-deps: pip install deepspeed failed (only the comparison benchmarks need it)" >&2
fi
