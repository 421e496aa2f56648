#!/bin/sh
# Installs one image's set of pagedkv parts into a fresh virtual environment,
# pinned by constraints.txt. The Dockerfiles run it, and so does
# `make image-install-check` in a fresh venv, so a broken install step fails
# CI rather than a user's image build.
#
#   deploy/install.sh scheduler|executor VENV
#
# scheduler: the torch-free side (shared, scheduler, router, client, gateway):
#   the `pagedkv scheduler`, `router`, `gateway`, `generate`, `stats` and
#   `demo --target` commands (those that start executors are not listed), no
#   torch;
# executor: every service part, torch and the Triton kernels included.
# Neither installs the benchmarks (bench/, pagedkv-bench): the images carry
# no benchmark code, and their `pagedkv bench` says so.
#
# Run it from the repository root (the images' build context). PYTHON picks
# the interpreter that makes the venv (default: python3). Extra pip options
# (an index, a wheel folder) come from pip's own environment variables.
set -eu

usage="usage: deploy/install.sh scheduler|executor VENV"
[ $# -eq 2 ] || { echo "$usage" >&2; exit 2; }
set_name=$1
venv=$2

case "$set_name" in
  scheduler) parts="./shared ./services/scheduler ./services/router ./services/client ./services/gateway" ;;
  executor) parts="./shared ./services/scheduler ./services/router ./services/client ./services/gateway ./kernels ./services/executor" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
[ -f constraints.txt ] || { echo "install.sh: run it from the repository root" >&2; exit 2; }

"${PYTHON:-python3}" -m venv "$venv"
# Regular (not editable) installs: the venv must not point back into the
# source tree, which the final image stage does not copy.
# shellcheck disable=SC2086  # $parts is a list of paths
"$venv/bin/pip" install --no-cache-dir --disable-pip-version-check \
  -c constraints.txt $parts
"$venv/bin/pagedkv" --help >/dev/null
