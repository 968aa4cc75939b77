package runner

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/internal/sharedtest"
)

func TestLoadConfigDefaults(t *testing.T) {
	cfg, err := LoadConfig([]string{"DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)}, nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want any
	}{
		{"ext_proc port", cfg.GRPCPort, 9002},
		{"health port", cfg.GRPCHealthPort, 9003},
		{"selection port", cfg.SelectionHTTPPort, 8092},
		{"metrics port", cfg.MetricsPort, 9090},
		{"block size", cfg.BlockSize, 16},
		{"kv events", bool(cfg.UseKVEvents), true},
		{"secure serving", bool(cfg.SecureServing), true},
		{"body cap", cfg.MaxRequestBodyBytes, int64(64 << 20)},
		{"inflight cap", cfg.MaxInflightRequests, 1024},
		{"destinations", cfg.MaxDestinations, 1},
		{"drain window", cfg.DrainTimeout.Duration(), 15 * time.Second},
		{"request body bound", cfg.RequestBodyTimeout.Duration(), 60 * time.Second},
		{"mode", cfg.Mode, "standalone"},
		{"credit", cfg.OverlapScoreCredit, 1.0},
		{"host weight", cfg.HostCacheHitWeight, 0.75},
		{"disk weight", cfg.DiskCacheHitWeight, 0.25},
		{"expiry", cfg.ActiveRequestExpiry.Duration(), 300 * time.Second},
		{"tokenizer protocol", cfg.EffectiveTokenizerProtocol(), "local"},
		{"tokenization timeout", cfg.TokenizationTimeout.Duration(), 5 * time.Second},
		{"log level", cfg.LogLevel, "info"},
		{"queue policy", cfg.QueuePolicy, "fcfs"},
		{"overlap refresh", cfg.OverlapRefreshAfter.Duration(), 10 * time.Second},
		{"approximate cache policy", cfg.ApproximateCachePolicy, "ttl"},
		{"KV event port", cfg.KVEventPort, 5557},
		{"KV event replay port (off)", cfg.KVEventReplayPort, 0},
		{"conformance test hooks", bool(cfg.ConformanceTestHooks), false},
	}
	for _, c := range checks {
		t.Run("the default "+c.name+" is the spec's", func(t *testing.T) {
			if c.got != c.want {
				t.Fatalf("got %v, want %v", c.got, c.want)
			}
		})
	}
}

func TestLoadConfigParsesValues(t *testing.T) {
	tok := sharedtest.Qwen3TokenizerDir(t)
	tests := []struct {
		name  string
		env   []string
		args  []string
		check func(t *testing.T, c Config)
	}{
		{
			name: "booleans accept yes and no in any case",
			env:  []string{"DYN_ROUTER_USE_KV_EVENTS=No", "DYN_EPP_SECURE_SERVING=YES", "DYN_ROUTER_TRACK_PREFILL_TOKENS=0"},
			check: func(t *testing.T, c Config) {
				if c.UseKVEvents || !c.SecureServing || c.TrackPrefillTokens {
					t.Fatalf("use_kv_events=%v secure=%v track_prefill=%v", c.UseKVEvents, c.SecureServing, c.TrackPrefillTokens)
				}
			},
		},
		{
			name: "the alias DYN_USE_KV_EVENTS is honoured",
			env:  []string{"DYN_USE_KV_EVENTS=false"},
			check: func(t *testing.T, c Config) {
				if c.UseKVEvents {
					t.Fatal("alias ignored")
				}
			},
		},
		{
			name: "the canonical name wins over its alias",
			env:  []string{"DYN_SECURE_SERVING=false", "DYN_EPP_SECURE_SERVING=true"},
			check: func(t *testing.T, c Config) {
				if !c.SecureServing {
					t.Fatal("alias overrode the canonical variable")
				}
			},
		},
		{
			name: "the alias DYN_SECURE_SERVING turns TLS off",
			env:  []string{"DYN_SECURE_SERVING=false"},
			check: func(t *testing.T, c Config) {
				if c.SecureServing {
					t.Fatal("alias ignored")
				}
			},
		},
		{
			name: "flags override the environment",
			env:  []string{"DYN_EPP_GRPC_PORT=1234", "DYN_KV_CACHE_BLOCK_SIZE=32"},
			args: []string{"--grpc-port", "4321", "--secure-serving=false", "--block-size=64"},
			check: func(t *testing.T, c Config) {
				if c.GRPCPort != 4321 || c.SecureServing || c.BlockSize != 64 {
					t.Fatalf("port=%d secure=%v bs=%d", c.GRPCPort, c.SecureServing, c.BlockSize)
				}
			},
		},
		{
			name: "a bare boolean flag means true",
			env:  []string{"DYN_EPP_SECURE_SERVING=false"},
			args: []string{"-secure-serving"},
			check: func(t *testing.T, c Config) {
				if !c.SecureServing {
					t.Fatal("--secure-serving did not turn TLS on")
				}
			},
		},
		{
			name: "--no-router-assume-kv-reuse turns reuse off",
			args: []string{"--no-router-assume-kv-reuse"},
			check: func(t *testing.T, c Config) {
				if c.AssumeKVReuse {
					t.Fatal("still on")
				}
			},
		},
		{
			name: "per-model tokenizer directories are parsed from model=dir lists",
			env:  []string{"DYN_EPP_TOKENIZERS=Qwen/Qwen3-0.6B=" + tok + ", other=" + tok},
			check: func(t *testing.T, c Config) {
				if len(c.Tokenizers) != 2 || c.Tokenizers["Qwen/Qwen3-0.6B"] != tok || c.Tokenizers["other"] != tok {
					t.Fatalf("tokenizers = %v", c.Tokenizers)
				}
			},
		},
		{
			name: "fractional drain seconds are accepted",
			env:  []string{"DYN_EPP_DRAIN_TIMEOUT_SECS=0.25"},
			check: func(t *testing.T, c Config) {
				if c.DrainTimeout.Duration() != 250*time.Millisecond {
					t.Fatalf("drain = %v", c.DrainTimeout.Duration())
				}
			},
		},
		{
			name: "an empty variable means the default",
			env:  []string{"DYN_EPP_GRPC_PORT="},
			check: func(t *testing.T, c Config) {
				if c.GRPCPort != 9002 {
					t.Fatalf("port = %d", c.GRPCPort)
				}
			},
		},
		{
			name: "the deprecated overlap score weight is read through its alias",
			env:  []string{"DYN_OVERLAP_SCORE_WEIGHT=0"},
			check: func(t *testing.T, c Config) {
				if !c.OverlapScoreWeight.Set || c.OverlapScoreWeight.Value != 0 {
					t.Fatalf("weight = %+v", c.OverlapScoreWeight)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := LoadConfig(append([]string{"DYN_EPP_TOKENIZER_DIR=" + tok}, tc.env...), tc.args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, cfg)
		})
	}
}

func TestLoadConfigInferencePool(t *testing.T) {
	cfg, err := LoadConfig([]string{"DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t), "DYN_EPP_INFERENCE_POOL_NAME=qwen",
		"POD_NAMESPACE=llm", "DYN_MODEL_NAME=Qwen/Qwen3-0.6B", "DYN_EPP_KV_EVENT_REPLAY_PORT=5560"},
		[]string{"--kv-event-port", "6000", "--conformance-test-hooks"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.InferencePoolName != "qwen" || cfg.PodNamespace != "llm" || cfg.KVEventPort != 6000 || cfg.KVEventReplayPort != 5560 || !bool(cfg.ConformanceTestHooks) {
		t.Fatalf("config %+v", cfg)
	}
}

func TestLoadConfigRejectsInvalidSettingsNamingThem(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	tests := []struct {
		name    string
		env     []string
		args    []string
		wantErr string
	}{
		{"a zero block size", []string{tok, "DYN_KV_CACHE_BLOCK_SIZE=0"}, nil, `invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`},
		{"a non-numeric block size", []string{tok, "DYN_KV_CACHE_BLOCK_SIZE=sixteen"}, nil, `invalid DYN_KV_CACHE_BLOCK_SIZE "sixteen": must be an integer`},
		{"a block size given by flag", []string{tok}, []string{"--block-size=-3"}, `invalid --block-size (DYN_KV_CACHE_BLOCK_SIZE) "-3": must be > 0`},
		{"an unparseable boolean", []string{tok, "DYN_ROUTER_USE_KV_EVENTS=maybe"}, nil, `invalid DYN_ROUTER_USE_KV_EVENTS "maybe": must be one of true, false, 1, 0, yes, no`},
		{"an unparseable boolean alias", []string{tok, "DYN_SECURE_SERVING=t"}, nil, `invalid DYN_EPP_SECURE_SERVING "t"`},
		{"a negative temperature", []string{tok, "DYN_ROUTER_TEMPERATURE=-1"}, nil, `invalid DYN_ROUTER_TEMPERATURE "-1": must be a finite number >= 0`},
		{"an infinite credit", []string{tok, "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=+Inf"}, nil, `invalid DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT "+Inf"`},
		{"a host weight above one", []string{tok, "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT=1.5"}, nil, `invalid DYN_ROUTER_HOST_CACHE_HIT_WEIGHT "1.5": must be in [0, 1]`},
		{"a port out of range", []string{tok, "DYN_EPP_GRPC_PORT=70000"}, nil, `invalid DYN_EPP_GRPC_PORT "70000": must be a port in 0..65535`},
		{"two listeners on one port", []string{tok, "DYN_EPP_METRICS_PORT=9002"}, nil, `invalid DYN_EPP_METRICS_PORT "9002": port is already used by DYN_EPP_GRPC_PORT`},
		{"a mode other than standalone", []string{tok, "DYN_EPP_MODE=disagg"}, nil, `invalid DYN_EPP_MODE "disagg": only standalone is implemented`},
		{"a zero body cap", []string{tok, "DYN_EPP_MAX_REQUEST_BODY_BYTES=0"}, nil, `invalid DYN_EPP_MAX_REQUEST_BODY_BYTES "0": must be > 0`},
		{"a zero inflight cap", []string{tok, "DYN_EPP_MAX_INFLIGHT_REQUESTS=0"}, nil, `invalid DYN_EPP_MAX_INFLIGHT_REQUESTS "0": must be > 0`},
		{"zero destinations", []string{tok, "DYN_EPP_MAX_DESTINATIONS=0"}, nil, `invalid DYN_EPP_MAX_DESTINATIONS "0": must be >= 1`},
		{"a negative drain window", []string{tok, "DYN_EPP_DRAIN_TIMEOUT_SECS=-1"}, nil, `invalid DYN_EPP_DRAIN_TIMEOUT_SECS "-1": must be >= 0`},
		{"no bound on a request body", []string{tok, "DYN_EPP_REQUEST_BODY_TIMEOUT_SECS=0"}, nil, `invalid DYN_EPP_REQUEST_BODY_TIMEOUT_SECS "0": must be > 0`},
		{"a zero expiry", []string{tok, "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS=0"}, nil, `invalid DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS "0": must be > 0`},
		{"a negative bound on a request body (the same rule as 0)", []string{tok, "DYN_EPP_REQUEST_BODY_TIMEOUT_SECS=-1"}, nil, `invalid DYN_EPP_REQUEST_BODY_TIMEOUT_SECS "-1": must be > 0`},
		{"a negative expiry (the same rule as 0)", []string{tok, "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS=-5"}, nil, `invalid DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS "-5": must be > 0`},
		{"a negative approximate TTL", []string{tok, "DYN_ROUTER_TTL_SECS=-0.5"}, nil, `invalid DYN_ROUTER_TTL_SECS "-0.5": must be > 0`},
		{"a negative recovery timeout", []string{tok, "DYN_EPP_INDEXER_PEERS=http://p:8092", "DYN_EPP_RECOVERY_TIMEOUT_SECS=-1"}, nil, `invalid DYN_EPP_RECOVERY_TIMEOUT_SECS "-1": must be > 0`},
		{"a pool name that is not a DNS subdomain", []string{tok, "POD_NAMESPACE=ns", "DYN_MODEL_NAME=m", "DYN_EPP_INFERENCE_POOL_NAME=Bad_Name"}, nil, `invalid DYN_EPP_INFERENCE_POOL_NAME "Bad_Name": must be a Kubernetes object name (DNS-1123 subdomain`},
		{"a namespace that is not a DNS label", []string{tok, "POD_NAMESPACE=my.ns", "DYN_MODEL_NAME=m", "DYN_EPP_INFERENCE_POOL_NAME=pool"}, nil, `invalid POD_NAMESPACE "my.ns": must be a Kubernetes namespace name (DNS-1123 label`},
		{"a zero recovery byte bound", []string{tok, "DYN_EPP_RECOVERY_MAX_BYTES=0"}, nil, `invalid DYN_EPP_RECOVERY_MAX_BYTES "0": must be > 0`},
		{"a zero recovery event bound", []string{tok, "DYN_EPP_RECOVERY_MAX_EVENTS=0"}, nil, `invalid DYN_EPP_RECOVERY_MAX_EVENTS "0": must be > 0`},
		{"output tracking without active blocks", []string{tok, "DYN_ROUTER_TRACK_ACTIVE_BLOCKS=false", "DYN_ROUTER_TRACK_OUTPUT_BLOCKS=true"}, nil, `invalid DYN_ROUTER_TRACK_OUTPUT_BLOCKS "true": requires DYN_ROUTER_TRACK_ACTIVE_BLOCKS=true`},
		{"no tokenizer while KV events are on", nil, nil, `no tokenizer is configured: set DYN_EPP_TOKENIZER_DIR`},
		{"tokenizer protocol none while KV events are on", []string{"DYN_EPP_TOKENIZER_PROTOCOL=none"}, nil, `invalid DYN_EPP_TOKENIZER_PROTOCOL "none": none is only allowed with DYN_ROUTER_USE_KV_EVENTS=false`},
		{"local tokenization without a directory", []string{"DYN_EPP_TOKENIZER_PROTOCOL=local"}, nil, `invalid DYN_EPP_TOKENIZER_DIR "": is required`},
		{"a tokenizer directory that does not exist", []string{"DYN_EPP_TOKENIZER_DIR=/nonexistent/tok"}, nil, `invalid DYN_EPP_TOKENIZER_DIR "/nonexistent/tok"`},
		{"vllm-render without a URL", []string{"DYN_EPP_TOKENIZER_PROTOCOL=vllm-render"}, nil, `invalid DYN_EPP_TOKENIZER_SERVICE_URL "": is required`},
		{"a vllm-render URL that is not absolute", []string{"DYN_EPP_TOKENIZER_SERVICE_URL=tok:8000"}, nil, `invalid DYN_EPP_TOKENIZER_SERVICE_URL "tok:8000": must be an absolute http(s) URL`},
		{"a per-model vllm-render URL that is not absolute", []string{"DYN_EPP_TOKENIZER_SERVICE_URLS=m=/render"}, nil, `invalid DYN_EPP_TOKENIZER_SERVICE_URLS[m] "/render": must be an absolute http(s) URL`},
		{"a non-positive render response bound", []string{"DYN_EPP_TOKENIZER_SERVICE_URL=http://tok:8000", "DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES=0"}, nil, `invalid DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES "0": must be > 0`},
		{"an unknown tokenizer protocol", []string{"DYN_EPP_TOKENIZER_PROTOCOL=remote"}, nil, `invalid DYN_EPP_TOKENIZER_PROTOCOL "remote": must be local, vllm-render or none`},
		{"a malformed tokenizers list", []string{"DYN_EPP_TOKENIZERS=qwen"}, nil, `invalid DYN_EPP_TOKENIZERS "qwen": entry "qwen" must be model=dir`},
		{"an InferencePool without POD_NAMESPACE", []string{tok, "DYN_MODEL_NAME=m", "DYN_EPP_INFERENCE_POOL_NAME=pool"}, nil, `POD_NAMESPACE is required with DYN_EPP_INFERENCE_POOL_NAME`},
		{"an InferencePool without DYN_MODEL_NAME", []string{tok, "POD_NAMESPACE=ns", "DYN_EPP_INFERENCE_POOL_NAME=pool"}, nil, `DYN_MODEL_NAME is required with DYN_EPP_INFERENCE_POOL_NAME`},
		{"an InferencePool and a workers file", []string{tok, "POD_NAMESPACE=ns", "DYN_MODEL_NAME=m", "DYN_EPP_INFERENCE_POOL_NAME=pool", "DYN_EPP_WORKERS_FILE=w.yaml"}, nil, `invalid DYN_EPP_INFERENCE_POOL_NAME "pool": set at most one of DYN_EPP_INFERENCE_POOL_NAME and DYN_EPP_WORKERS_FILE`},
		{"a KV event port of zero", []string{tok, "DYN_EPP_KV_EVENT_PORT=0"}, nil, `invalid DYN_EPP_KV_EVENT_PORT "0": must be a port in 1..65535`},
		{"a KV event replay port out of range", []string{tok, "DYN_EPP_KV_EVENT_REPLAY_PORT=65536"}, nil, `invalid DYN_EPP_KV_EVENT_REPLAY_PORT "65536"`},
		{"a pool namespace flag without a pool model", []string{tok, "DYN_EPP_INFERENCE_POOL_NAME=pool"}, []string{"--pod-namespace", "ns"}, `DYN_MODEL_NAME is required`},
		{"a container discovery mode", []string{tok, "DYN_KUBE_DISCOVERY_MODE=container"}, nil, `invalid DYN_KUBE_DISCOVERY_MODE "container"`},
		{"lru with KV events", []string{tok, "DYN_ROUTER_APPROXIMATE_CACHE_POLICY=lru"}, nil, `invalid DYN_ROUTER_APPROXIMATE_CACHE_POLICY "lru": lru is not allowed with DYN_ROUTER_USE_KV_EVENTS=true`},
		{"a session affinity TTL out of range", []string{tok, "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS=0"}, nil, `invalid DYN_ROUTER_SESSION_AFFINITY_TTL_SECS "0": must be a whole number of seconds in 1..31536000`},
		{"a shared cache type", []string{tok, "DYN_SHARED_CACHE_TYPE=lmcache"}, nil, `invalid DYN_SHARED_CACHE_TYPE "lmcache": only none is supported`},
		{"a tracking hash", []string{tok, "DYN_ROUTER_TRACKING_HASH=keyed"}, nil, `invalid DYN_ROUTER_TRACKING_HASH "keyed"`},
		{"a log level", []string{tok, "DYN_LOG=loud"}, nil, `invalid DYN_LOG "loud"`},
		{"a prune ratio of one", []string{tok, "DYN_ROUTER_PRUNE_TARGET_RATIO=1"}, nil, `invalid DYN_ROUTER_PRUNE_TARGET_RATIO "1": must be in (0, 1)`},
		{"a negative queue threshold", []string{tok, "DYN_ROUTER_QUEUE_THRESHOLD=-0.5"}, nil, `invalid DYN_ROUTER_QUEUE_THRESHOLD "-0.5"`},
		{"an unknown queue policy", []string{tok, "DYN_ROUTER_QUEUE_POLICY=sjf"}, nil, `invalid DYN_ROUTER_QUEUE_POLICY "sjf": must be fcfs, lcfs or wspt`},
		{"an upper-case queue policy", []string{tok, "DYN_ROUTER_QUEUE_POLICY=FCFS"}, nil, `invalid DYN_ROUTER_QUEUE_POLICY "FCFS"`},
		{"a negative overlap refresh", []string{tok, "DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS=-1"}, nil, `invalid DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS "-1": must be >= 0`},
		{"an unknown approximate cache policy", []string{tok, "DYN_ROUTER_USE_KV_EVENTS=false", "DYN_ROUTER_APPROXIMATE_CACHE_POLICY=fifo"}, nil, `invalid DYN_ROUTER_APPROXIMATE_CACHE_POLICY "fifo": must be ttl or lru`},
		{"a fractional max_num_batched_tokens", []string{tok, "DYN_EPP_MAX_NUM_BATCHED_TOKENS=1.5"}, nil, `invalid DYN_EPP_MAX_NUM_BATCHED_TOKENS "1.5": must be a whole number in 1..9007199254740992 (2^53)`},
		{"a cert path with plaintext serving", []string{tok, "DYN_EPP_SECURE_SERVING=false", "DYN_EPP_CERT_PATH=/certs"}, nil, `invalid DYN_EPP_CERT_PATH "/certs": requires DYN_EPP_SECURE_SERVING=true`},
		{"an unknown flag", []string{tok}, []string{"--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
		{"a positional argument", []string{tok}, []string{"serve"}, `unexpected argument "serve"`},
	}
	for _, tc := range tests {
		t.Run("startup fails on "+tc.name, func(t *testing.T) {
			_, err := LoadConfig(tc.env, tc.args, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error = %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
}

// TestStartupErrorsNameTheSettingAsTheUserGaveIt checks the wording of startup errors: the value
// is quoted as typed (not reformatted), an integer too large for its setting is "out of range"
// (not "must be an integer"), and a value given by flag names the flag and its variable.
func TestStartupErrorsNameTheSettingAsTheUserGaveIt(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	tests := []struct {
		name       string
		env, args  []string
		wantPrefix string
		notWant    string
	}{
		{"a session affinity TTL one second too long is echoed as typed", []string{tok, "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS=31536001"}, nil,
			`invalid DYN_ROUTER_SESSION_AFFINITY_TTL_SECS "31536001": must be a whole number of seconds in 1..31536000`, "e+07"},
		{"a session affinity TTL in exponent form is echoed as typed", []string{tok, "DYN_ROUTER_SESSION_AFFINITY_TTL_SECS=1e9"}, nil,
			`invalid DYN_ROUTER_SESSION_AFFINITY_TTL_SECS "1e9": `, "e+09"},
		{"a prune ratio written 1.0 is echoed as typed", []string{tok, "DYN_ROUTER_PRUNE_TARGET_RATIO=1.0"}, nil,
			`invalid DYN_ROUTER_PRUNE_TARGET_RATIO "1.0": must be in (0, 1)`, ""},
		{"a fractional whole-number setting is echoed as typed", []string{tok, "DYN_EPP_TOTAL_KV_BLOCKS=2.50"}, nil,
			`invalid DYN_EPP_TOTAL_KV_BLOCKS "2.50": must be a whole number in 1..9007199254740992 (2^53)`, ""},
		{"a 20-digit body cap is out of range, not a non-integer", []string{tok, "DYN_EPP_MAX_REQUEST_BODY_BYTES=99999999999999999999"}, nil,
			`invalid DYN_EPP_MAX_REQUEST_BODY_BYTES "99999999999999999999": is out of range`, "must be an integer"},
		{"a 20-digit port is out of range, not a non-integer", []string{tok, "DYN_EPP_GRPC_PORT=-99999999999999999999"}, nil,
			`invalid DYN_EPP_GRPC_PORT "-99999999999999999999": is out of range`, "must be an integer"},
		{"a 20-digit tokenization timeout is too large, not a non-integer", []string{tok, "DYN_EPP_TOKENIZATION_TIMEOUT_MS=99999999999999999999"}, nil,
			`invalid DYN_EPP_TOKENIZATION_TIMEOUT_MS "99999999999999999999": is too large`, "must be an integer"},
		{"a queue threshold beyond float range is out of range", []string{tok, "DYN_ROUTER_QUEUE_THRESHOLD=1e400"}, nil,
			`invalid DYN_ROUTER_QUEUE_THRESHOLD "1e400": is out of range`, ""},
		{"a non-integer body cap still must be an integer", []string{tok, "DYN_EPP_MAX_REQUEST_BODY_BYTES=64MiB"}, nil,
			`invalid DYN_EPP_MAX_REQUEST_BODY_BYTES "64MiB": must be an integer`, ""},
		{"--block-size 0 names the flag and its variable", []string{tok}, []string{"--block-size", "0"},
			`invalid --block-size (DYN_KV_CACHE_BLOCK_SIZE) "0": must be > 0`, ""},
		{"a non-numeric --block-size names the flag and its variable", []string{tok}, []string{"--block-size", "x"},
			`invalid --block-size (DYN_KV_CACHE_BLOCK_SIZE) "x": must be an integer`, ""},
		{"--block-size overriding a valid variable names the flag", []string{tok, "DYN_KV_CACHE_BLOCK_SIZE=16"}, []string{"--block-size=0"},
			`invalid --block-size (DYN_KV_CACHE_BLOCK_SIZE) "0": must be > 0`, ""},
		{"DYN_KV_CACHE_BLOCK_SIZE=0 names only the variable", []string{tok, "DYN_KV_CACHE_BLOCK_SIZE=0"}, nil,
			`invalid DYN_KV_CACHE_BLOCK_SIZE "0": must be > 0`, "--block-size"},
		{"--session-affinity-ttl-secs names the flag and quotes it as typed", []string{tok}, []string{"--session-affinity-ttl-secs=31536001"},
			`invalid --session-affinity-ttl-secs (DYN_ROUTER_SESSION_AFFINITY_TTL_SECS) "31536001": `, ""},
		{"a port clash names the flag on both sides", []string{tok}, []string{"--grpc-port=9100", "--metrics-port=9100"},
			`invalid --metrics-port (DYN_EPP_METRICS_PORT) "9100": port is already used by --grpc-port (DYN_EPP_GRPC_PORT)`, ""},
		{"a missing --tokenizer-dir names the flag", nil, []string{"--tokenizer-dir=/nonexistent/tok"},
			`invalid --tokenizer-dir (DYN_EPP_TOKENIZER_DIR) "/nonexistent/tok": `, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := LoadConfig(tc.env, tc.args, io.Discard)
			if err == nil || !strings.HasPrefix(err.Error(), tc.wantPrefix) {
				t.Fatalf("error = %v, want it to start with %q", err, tc.wantPrefix)
			}
			if tc.notWant != "" && strings.Contains(err.Error(), tc.notWant) {
				t.Fatalf("error %q contains %q", err, tc.notWant)
			}
		})
	}
}

// TestPolicyErrorsNameOnlyTheSettingsGiven checks that a worker-selection policy error names
// DYN_ROUTER_POLICY_CONFIG and DYN_ROUTER_WORKER_SELECTION_POLICY only when each is set (with the
// flag when a flag set it), never an unset one with an empty value.
func TestPolicyErrorsNameOnlyTheSettingsGiven(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	dir := t.TempDir()
	write := func(name, doc string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// bad loads but does not resolve (an instance of an unregistered type); unloadable fails
	// its own validation.
	bad := write("bad.yaml", "worker_selection:\n  instances:\n    - {name: x, type: no-such-type}\n")
	unloadable := write("unloadable.yaml", "worker_selection:\n  default: missing\n")
	tests := []struct {
		name      string
		env, args []string
		want      string
		notWant   []string
	}{
		{"a policy file whose default instance is missing names only the file", []string{tok, "DYN_ROUTER_POLICY_CONFIG=" + bad}, nil,
			`invalid DYN_ROUTER_POLICY_CONFIG "` + bad + `": `, []string{"DYN_ROUTER_WORKER_SELECTION_POLICY", `""`}},
		{"an unknown instance without a file names only the instance", []string{tok, "DYN_ROUTER_WORKER_SELECTION_POLICY=nope"}, nil,
			`invalid DYN_ROUTER_WORKER_SELECTION_POLICY "nope": `, []string{"DYN_ROUTER_POLICY_CONFIG"}},
		{"a policy file that fails validation names only the file", []string{tok, "DYN_ROUTER_POLICY_CONFIG=" + unloadable}, nil,
			`invalid DYN_ROUTER_POLICY_CONFIG "` + unloadable + `": `, []string{"DYN_ROUTER_WORKER_SELECTION_POLICY"}},
		{"a file and an instance that both were given are both named", []string{tok, "DYN_ROUTER_POLICY_CONFIG=" + bad, "DYN_ROUTER_WORKER_SELECTION_POLICY=nope"}, nil,
			`invalid DYN_ROUTER_POLICY_CONFIG "` + bad + `" / DYN_ROUTER_WORKER_SELECTION_POLICY "nope": `, nil},
		{"a policy file given by flag names the flag", []string{tok}, []string{"--router-policy-config=" + bad},
			`invalid --router-policy-config (DYN_ROUTER_POLICY_CONFIG) "` + bad + `": `, []string{"DYN_ROUTER_WORKER_SELECTION_POLICY"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := LoadConfig(tc.env, tc.args, io.Discard)
			if err != nil {
				t.Fatalf("LoadConfig: %v", err)
			}
			_, err = pickerConfig(cfg, catalog.Builtins(), zerolog.Nop())
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("error = %v, want it to start with %q", err, tc.want)
			}
			for _, nw := range tc.notWant {
				if strings.Contains(err.Error(), nw) {
					t.Fatalf("error %q contains %q", err, nw)
				}
			}
		})
	}
}

func TestLoadConfigHelp(t *testing.T) {
	var out strings.Builder
	_, err := LoadConfig(nil, []string{"-h"}, &out)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("error = %v, want flag.ErrHelp", err)
	}
	for _, want := range []string{"-grpc-port", "env DYN_EPP_GRPC_PORT, default 9002", "-workers-file",
		"epp select-service [flags]", "epp route [flags]", "-request-body-timeout-secs"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("usage lacks %q:\n%s", want, out.String())
		}
	}
}

func TestDefaultConfigValidatesWithATokenizer(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TokenizerDir = sharedtest.Qwen3TokenizerDir(t)
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestLoadSelectServiceConfig(t *testing.T) {
	t.Run("no tokenizer is needed and ext_proc ports are not checked", func(t *testing.T) {
		cfg, err := LoadSelectServiceConfig([]string{"DYN_EPP_GRPC_PORT=8100", "DYN_EPP_SELECTION_HTTP_PORT=8100"})
		if err != nil {
			t.Fatal(err)
		}
		if cfg.SelectionHTTPPort != 8100 {
			t.Fatalf("port=%d", cfg.SelectionHTTPPort)
		}
	})
	t.Run("router settings are still validated by name", func(t *testing.T) {
		_, err := LoadSelectServiceConfig([]string{"DYN_ROUTER_TEMPERATURE=-1"})
		if err == nil || !strings.Contains(err.Error(), `invalid DYN_ROUTER_TEMPERATURE "-1"`) {
			t.Fatalf("error = %v", err)
		}
	})
	t.Run("an out-of-range port is rejected", func(t *testing.T) {
		_, err := LoadSelectServiceConfig([]string{"DYN_EPP_SELECTION_HTTP_PORT=99999"})
		if err == nil || !strings.Contains(err.Error(), `invalid DYN_EPP_SELECTION_HTTP_PORT "99999"`) {
			t.Fatalf("error = %v", err)
		}
	})
}

func TestCanonicalSettingName(t *testing.T) {
	for name, want := range map[string]string{
		"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
		"DYN_LOG_LEVEL":                      "DYN_LOG",
		"DYN_USE_KV_EVENTS":                  "DYN_ROUTER_USE_KV_EVENTS",
		"DYN_ROUTER_NO_SUCH":                 "",
		"overlap_score_credit":               "",
	} {
		got, ok := CanonicalSettingName(name)
		if got != want || ok != (want != "") {
			t.Errorf("CanonicalSettingName(%q) = %q, %v; want %q", name, got, ok, want)
		}
	}
}
