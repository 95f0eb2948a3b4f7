#!/usr/bin/env bash
# The C++ dependencies for a GPU machine that cannot reach a package registry (the lent device
# machine: CUDA, PyTorch, CMake and a compiler, but no liburing, oneTBB, GoogleTest, ...).
#
#   scripts/gpu-deps.sh fetch        here, with the network: the Debian 12 packages into
#                                    .gpu-deps/ (git-ignored; carried to the GPU machine),
#                                    Python 3.12's headers if pyenv has them, and the nanobind
#                                    the binding is built with here (its sources: any Python)
#   source scripts/gpu-deps.sh use   there: unpacks them into a prefix under /tmp (never into
#                                    /) and exports what CMake, pkg-config and the loader need
#
# Debian 12's libraries run on a newer glibc (the GPU image is Ubuntu 24.04's), so the same
# packages serve both. bench/gpu-check.sh calls `use` when pkg-config cannot find liburing.
packages=(
  liburing2 liburing-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15 libtbb-dev
  nlohmann-json3-dev libcli11-dev googletest libgtest-dev libgmock-dev libbenchmark1debian
  libbenchmark-dev libopenblas0-pthread libopenblas-pthread-dev libgfortran5 pkgconf-bin
  libpkgconf3
)
_gpu_deps_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_gpu_deps_dir=$_gpu_deps_root/.gpu-deps

gpu_deps_fetch() {
  set -euo pipefail
  mkdir -p "$_gpu_deps_dir"
  grep -qx '/.gpu-deps/' "$_gpu_deps_root/.git/info/exclude" 2>/dev/null ||
    echo /.gpu-deps/ >>"$_gpu_deps_root/.git/info/exclude"
  (cd "$_gpu_deps_dir" && rm -f ./*.deb && apt-get download "${packages[@]}" >/dev/null)
  local inc
  inc=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/include/python3.12 2>/dev/null | tail -1)
  if [ -n "$inc" ]; then
    rm -rf "$_gpu_deps_dir/python3.12" && cp -r "$inc" "$_gpu_deps_dir/python3.12"
  fi
  local nb
  nb=$("$_gpu_deps_root/.venv/bin/python" -c 'import nanobind, os; print(os.path.dirname(nanobind.__file__))')
  rm -rf "$_gpu_deps_dir/nanobind" && cp -r "$nb" "$_gpu_deps_dir/nanobind"
  find "$_gpu_deps_dir/nanobind" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$_gpu_deps_dir"
}

gpu_deps_use() {
  local p=/tmp/strata-deps f
  if [ ! -f "$p/.unpacked" ]; then  # once per machine: a second `use` finds it ready
    rm -rf "$p"
    for f in "$_gpu_deps_dir"/*.deb; do dpkg-deb -x "$f" "$p" || return 1; done
    # The .pc files name /usr; here everything is under $p/usr.
    find "$p" -name '*.pc' -exec sed -i "s#/usr#$p/usr#g" {} +
    touch "$p/.unpacked"
  fi
  local lib=$p/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH=$p/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PKG_CONFIG_PATH=$lib/pkgconfig:$lib/openblas-pthread/pkgconfig
  export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  command -v pkg-config >/dev/null || export PKG_CONFIG=$p/usr/bin/pkgconf
  echo "gpu-deps: using the Debian packages unpacked in $p"
}

case "${1:-}" in
  fetch) gpu_deps_fetch ;;
  use) gpu_deps_use ;;
  *) echo "usage: scripts/gpu-deps.sh fetch | source scripts/gpu-deps.sh use" >&2 ;;
esac
