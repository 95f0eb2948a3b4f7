#!/usr/bin/env bash
# Installs what strata needs to build and test on Debian 12, as root. Idempotent: installs only
# the packages that are missing. The CUDA toolkit is not a Debian package; when it is present
# (/usr/local/cuda) the CUDA backend is built too, else only the host backend.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  liburing-dev libtbb-dev libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libopenblas-dev
  clang libclang-rt-14-dev
  fio
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
# Python's safetensors and numpy serve one interop test (skipped without them): best effort.
if ! python3 -c "import numpy, safetensors" 2>/dev/null; then
  python3 -m pip install --quiet numpy safetensors 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages numpy safetensors 2>/dev/null ||
    echo "install-deps: could not pip install numpy safetensors (the interop test will skip)"
fi
