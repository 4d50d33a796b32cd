#!/usr/bin/env bash
# Installs the Debian packages attn builds with, when any is missing; when all
# are installed it only asks dpkg and returns (no apt-get, no network).
# Root on the project's machines; sudo otherwise. Nothing is downloaded at build time.
# Why each package is there: README.md, "Dependencies".
set -euo pipefail
pkgs=(g++ cmake make pkg-config libgtest-dev libhwy-dev libdnnl-dev libopenblas-dev libopenblas-openmp-dev
      libcli11-dev nlohmann-json3-dev libfmt-dev libpng-dev python3-dev python3-venv
      libopenmpi-dev openmpi-bin
      emscripten node-acorn chromium chromium-driver)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
