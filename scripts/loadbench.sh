#!/usr/bin/env bash
# Side-by-side ext_proc load benchmark (README "ext_proc load benchmark"): builds kvepp, eppbench
# and the Gateway API Inference Extension's lightweight EPP (../shared/tools/lwepppeer), starts
# kvepp with the Qwen3 tokenizer on examples/workers.yaml and the lightweight EPP, runs
# `eppbench load` against both, prints its markdown table, and stops both.
#
#   bash scripts/loadbench.sh                      # the issue-15 goal table (≈ 5 min)
#   bash scripts/loadbench.sh --body chat-long --concurrency 8 --duration 10s   # any eppbench load flags
#
# LOADBENCH_KVEPP_CPUPROFILE=FILE writes a CPU profile of the kvepp process over the whole run
# (kvepp then runs as eppbench's kvepp child: the same composition root and settings as cmd/epp).
#
# Ports: $LOADBENCH_PORT_BASE (default 19000) + 2, 3, 90, 92 for kvepp, + 102 for the lightweight EPP.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
shared="$repo/../shared"
base="${LOADBENCH_PORT_BASE:-19000}"
work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

echo "loadbench: building kvepp, eppbench and the lightweight EPP in $work" >&2
# -tags vtprotobuf as the Dockerfile builds cmd/epp (extproc/codec.go); eppbench's kvepp child too.
go build -tags vtprotobuf -o "$work/epp" ./cmd/epp
go build -tags vtprotobuf -o "$work/eppbench" ./cmd/eppbench
(cd "$shared/tools/lwepppeer" && go build -o "$work/lwepppeer" .)

for port in $((base + 2)) $((base + 102)); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "loadbench: port $port is in use by another process; set LOADBENCH_PORT_BASE" >&2
    exit 1
  fi
done
kveppcmd=("$work/epp")
kveppin=/dev/null
if [ -n "${LOADBENCH_KVEPP_CPUPROFILE:-}" ]; then
  # eppbench's kvepp child (cmd/eppbench/kvepp.go) profiles itself and stops when its stdin
  # closes, so it reads a FIFO this script holds open until the end.
  profile="$(realpath -m "$LOADBENCH_KVEPP_CPUPROFILE")"
  kveppcmd=(env EPPBENCH_KVEPP_CHILD=1 "EPPBENCH_KVEPP_CPUPROFILE=$profile" "$work/eppbench")
  kveppin="$work/kvepp.stdin"
  mkfifo "$kveppin"
  exec 3<>"$kveppin"
fi
DYN_EPP_WORKERS_FILE="$repo/examples/workers.yaml" DYN_EPP_TOKENIZER_DIR="$shared/models/qwen3" \
  DYN_EPP_SECURE_SERVING=false DYN_EPP_BIND_ADDRESS=127.0.0.1 DYN_EPP_DRAIN_TIMEOUT_SECS=0 \
  DYN_EPP_GRPC_PORT=$((base + 2)) DYN_EPP_GRPC_HEALTH_PORT=$((base + 3)) \
  DYN_EPP_SELECTION_HTTP_PORT=$((base + 92)) DYN_EPP_METRICS_PORT=$((base + 90)) DYN_LOG=warn \
  "${kveppcmd[@]}" >"$work/kvepp.log" 2>&1 <"$kveppin" &
kvepp=$!
pids+=("$kvepp")
"$work/lwepppeer" -addr "127.0.0.1:$((base + 102))" >"$work/lwepp.log" 2>&1 &
lwepp=$!
pids+=("$lwepp")

# kvepp opens its ext_proc port once the tokenizer is loaded.
for _ in $(seq 1 120); do
  if (exec 3<>"/dev/tcp/127.0.0.1/$((base + 2))") 2>/dev/null; then break; fi
  if ! kill -0 "$kvepp" 2>/dev/null; then cat "$work/kvepp.log" >&2; exit 1; fi
  sleep 0.5
done

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(--body chat-long --body conv:turns=10 --body conv:turns=20 --body conv:turns=30
    --concurrency 1,8 --duration 5s --warmup 1s --rounds 3)
fi
"$work/eppbench" load --shared "$shared" \
  --target "kvepp=127.0.0.1:$((base + 2))" --pid "kvepp=$kvepp" \
  --target "lwepp=127.0.0.1:$((base + 102))" --pid "lwepp=$lwepp" \
  "${args[@]}"
