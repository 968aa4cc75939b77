#!/usr/bin/env bash
# Prepares the kube-apiserver and etcd binaries that the Kubernetes discovery tests run against
# (controller-runtime envtest), in a directory outside the checkout:
# ${KVEPP_ENVTEST_ASSETS:-$HOME/.cache/kvepp/envtest-assets}. It runs the project's shared tool
# ../shared/tools/envtest-assets.sh, which builds kube-apiserver v1.34.4 from the Go module proxy
# (about 4-5 minutes on 2 cores the first time) and installs Debian's etcd-server; a directory that
# already holds both binaries is left as it is (seconds). scripts/test.sh uses the directory when
# both binaries are there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir="${KVEPP_ENVTEST_ASSETS:-$HOME/.cache/kvepp/envtest-assets}"
tool="../shared/tools/envtest-assets.sh"
if [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]]; then
  echo "envtest-assets.sh: $dir already holds kube-apiserver and etcd" >&2
  exit 0
fi
if [[ ! -f "$tool" ]]; then
  echo "envtest-assets.sh: $tool not found (the project's shared/ folder must sit beside this checkout)" >&2
  exit 1
fi
start=$(date +%s)
bash "$tool" "$dir"
echo "envtest-assets.sh: prepared $dir in $(( $(date +%s) - start ))s" >&2
