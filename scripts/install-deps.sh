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
# The Python side lives in a project virtual environment (.venv at the repository root; Debian's
# own python is externally managed): numpy and safetensors for the interop test and the numpy
# reference of stream_inference, pytest. Tests run with .venv/bin/python (CMake's STRATA_PYTHON),
# so a failed install here fails the test run instead of skipping it.
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${STRATA_VENV:-$root/.venv}
python_packages=(numpy safetensors pytest)
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || { echo "install-deps: python3 -m venv $venv failed" >&2; exit 1; }
fi
if ! "$venv/bin/python" -c "import numpy, safetensors, pytest" 2>/dev/null; then
  echo "install-deps: installing ${python_packages[*]} into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${python_packages[@]}" ||
    { echo "install-deps: pip install ${python_packages[*]} into $venv failed" >&2; exit 1; }
fi
echo "install-deps: $venv has ${python_packages[*]}"
