package main

import (
	"bytes"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/runner"
)

// TestMain lets the test binary play the kvepp child process that the benchmark starts (it
// re-executes its own binary, which in tests is this test binary).
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		os.Exit(runChild())
	}
	os.Exit(m.Run())
}

func TestParseFlags(t *testing.T) {
	cases := []struct {
		name    string
		args    []string
		check   func(Options) bool
		wantErr string
	}{
		{"no flags run the synthetic demo with its defaults", nil,
			func(o Options) bool {
				return o.Trace == "" && o.Speedup == synthSpeedup && o.CapacityBlocks == synthCapacity && o.Workers == 4
			}, ""},
		{"a trace takes the trace defaults", []string{"--trace", "x.jsonl"},
			func(o Options) bool { return o.Speedup == traceSpeedup && o.CapacityBlocks == traceCapacity }, ""},
		{"explicit values win over the defaults", []string{"--trace", "x.jsonl", "--speedup", "7", "--capacity-blocks", "100"},
			func(o Options) bool { return o.Speedup == 7 && o.CapacityBlocks == 100 }, ""},
		{"zero workers are refused", []string{"--workers", "0"}, nil, "--workers 0"},
		{"a block size that does not divide 512 is refused for traces", []string{"--trace", "x", "--block-size", "48"}, nil, "--block-size 48"},
		{"a negative speedup is refused", []string{"--speedup", "-1"}, nil, "--speedup"},
		{"a zero stream interval is refused", []string{"--stream-interval", "0"}, nil, "--stream-interval 0"},
		{"stray arguments are refused", []string{"extra"}, nil, `unexpected argument "extra"`},
		{"the built-in policy is named kvepp, not default", []string{"--policies", "default"}, nil, `use "kvepp"`},
		{"the vllm engine with its default profile is the default", nil,
			func(o Options) bool {
				return o.Engine == "vllm" && o.Profile == "llama-3.1-8b-a100-80gb" && o.streamFraction == 1 && o.simProfile().MaxNumSeqs == 256
			}, ""},
		{"the simple engine takes its batch limit", []string{"--engine", "simple"},
			func(o Options) bool { return o.BatchLimit == simpleBatchLimit }, ""},
		{"--batch-limit and --max-num-batched-tokens override the profile", []string{"--batch-limit", "32", "--max-num-batched-tokens", "4096"},
			func(o Options) bool { p := o.simProfile(); return p.MaxNumSeqs == 32 && p.MaxNumBatchedTokens == 4096 }, ""},
		{"--stream takes true, false and a fraction", []string{"--stream", "0.25"},
			func(o Options) bool { return o.streamFraction == 0.25 }, ""},
		{"--stream false streams nothing", []string{"--stream", "FALSE"},
			func(o Options) bool { return o.streamFraction == 0 }, ""},
		{"a bad --stream is refused", []string{"--stream", "sometimes"}, nil, `--stream "sometimes"`},
		{"an unknown engine is refused", []string{"--engine", "tgi"}, nil, `--engine "tgi"`},
		{"an unknown profile is refused with the presets", []string{"--profile", "h200"}, nil, "llama-3.1-8b-a100-80gb"},
		{"--skip needs a trace", []string{"--skip", "10"}, nil, "--skip 10"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(tc.args, io.Discard)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || !tc.check(o) {
				t.Fatalf("options %+v, error %v", o, err)
			}
		})
	}
}

func TestBaselines(t *testing.T) {
	o := defaultOptions()
	o.Policies = "random, two-tier-cache-aware,kvepp"
	got, err := o.baselines()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, b := range got {
		names = append(names, b.Name)
	}
	want := "kvepp,kvepp-dynamo,kvepp-approx,round-robin,random,least-active-requests,two-tier-cache-aware"
	if strings.Join(names, ",") != want {
		t.Fatalf("baselines %v, want %s (duplicates dropped, order kept)", names, want)
	}
	// kvepp and kvepp-approx select nothing (what the EPP runs out of the box); kvepp-dynamo
	// selects the built-in cost.
	if got[0].Instance != "" || !got[0].UseKVEvents || got[1].Instance != "default" || !got[1].UseKVEvents ||
		got[2].Instance != "" || got[2].UseKVEvents {
		t.Fatalf("kvepp baselines %+v %+v %+v", got[0], got[1], got[2])
	}
}

func TestKveppBaselineSettings(t *testing.T) {
	o := defaultOptions()
	o.Baselines = "kvepp,kvepp:track_active_blocks=false,overlap_score_credit=2,kvepp-approx:router_temperature=0.5"
	got, err := o.baselines()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0].Env != nil {
		t.Fatalf("baselines %+v, want three with the plain kvepp first and untouched", got)
	}
	if got[1].Name != "kvepp:track_active_blocks=false,overlap_score_credit=2" || !got[1].UseKVEvents ||
		strings.Join(got[1].Env, " ") != "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=2 DYN_ROUTER_TRACK_ACTIVE_BLOCKS=false" {
		t.Errorf("tuned kvepp %+v", got[1])
	}
	if got[2].UseKVEvents || strings.Join(got[2].Env, " ") != "DYN_ROUTER_TEMPERATURE=0.5" {
		t.Errorf("tuned kvepp-approx %+v", got[2])
	}
	for list, wantErr := range map[string]string{
		"kvepp:no_such_knob=1": `"no_such_knob" is not a kvepp setting`,
		"kvepp:overlap_score_credit=6,DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=10": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT is given twice",
		"kvepp:use_kv_events=false":                     "DYN_ROUTER_USE_KV_EVENTS is set by eppbench itself: use the kvepp-approx router",
		"kvepp:DYN_LOG_LEVEL=debug":                     "DYN_LOG is set by eppbench itself: use --log-level",
		"kvepp-approx:kv_cache_block_size=32":           "use --block-size",
		"kvepp:epp_secure_serving=true":                 "DYN_EPP_SECURE_SERVING is set by eppbench itself",
		"kvepp:temperature":                             "temperature needs a value",
		"kvepp:temperature=":                            "temperature needs a value",
		"kvepp :temperature=0.5,kvepp: temperature=0.5": "would share the result files",
	} {
		o.Baselines = list
		if _, err := o.baselines(); err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("%s: error %v, want one containing %q", list, err, wantErr)
		}
	}
	// Values pass on exactly as written (kvepp parses them), even YAML-special or ':'-holding ones
	// in a later position, and aliases resolve to their variable.
	o.Baselines = "kvepp:max_tree_size=100000000,DYN_OVERLAP_SCORE_WEIGHT=0x10,track_active_blocks=off,epp_indexer_peers=http://127.0.0.1:9,epp_cert_path=@certs"
	got, err = o.baselines()
	if err != nil {
		t.Fatal(err)
	}
	want := "DYN_EPP_CERT_PATH=@certs DYN_EPP_INDEXER_PEERS=http://127.0.0.1:9 DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT=0x10 DYN_ROUTER_MAX_TREE_SIZE=100000000 DYN_ROUTER_TRACK_ACTIVE_BLOCKS=off"
	if strings.Join(got[0].Env, " ") != want {
		t.Errorf("settings %q, want %s", got[0].Env, want)
	}
}

func TestKveppEnvFlag(t *testing.T) {
	o, err := parseFlags([]string{"--kvepp-env", "overlap_score_credit=2", "--kvepp-env", "DYN_ROUTER_TEMPERATURE=0.5"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(o.KveppEnv, " ") != "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=2 DYN_ROUTER_TEMPERATURE=0.5" {
		t.Errorf("--kvepp-env settings %q", o.KveppEnv)
	}
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"--kvepp-env", "DYN_ROUTER_NO_SUCH=1"}, `"DYN_ROUTER_NO_SUCH" is not a kvepp setting`},
		{[]string{"--kvepp-env", "overlap_score_credit=2", "--kvepp-env", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=3"}, "given twice"},
		{[]string{"--kvepp-env", "DYN_EPP_GRPC_PORT=9002"}, "set by eppbench itself"},
		{[]string{"--kvepp-env", "novalue"}, "want KEY=VALUE"},
		{[]string{"--kvepp-env", "DYN_ROUTER_TEMPERATURE="}, "want KEY=VALUE"},
	} {
		if _, err := parseFlags(tc.args, io.Discard); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%q: error %v, want one containing %q", tc.args, err, tc.wantErr)
		}
	}
}

func TestBenchOwnedSettingsMatchEnviron(t *testing.T) {
	set := map[string]bool{}
	for _, kv := range (kveppSpec{}).environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "DYN_") {
			set[name] = true
			if _, owned := benchOwnedSettings[name]; !owned {
				t.Errorf("environ sets %s but benchOwnedSettings does not list it", name)
			}
			if _, ok := runner.CanonicalSettingName(name); !ok {
				t.Errorf("environ sets %s, which kvepp does not read", name)
			}
		}
	}
	for name := range benchOwnedSettings {
		if !set[name] {
			t.Errorf("benchOwnedSettings lists %s but environ does not set it", name)
		}
	}
}

func TestCheckKveppConfigsFindsBadValuesBeforeAnythingRuns(t *testing.T) {
	o := defaultOptions()
	o.Baselines = "kvepp,round-robin,kvepp:overlap_score_credit=abc"
	baselines, err := o.baselines()
	if err != nil {
		t.Fatal(err)
	}
	rc := RunConfig{Speedup: 20, Sim: SimConfig{BlockSize: 16}, Model: "sim-model", TokenizerDir: t.TempDir(),
		PolicyConfig: filepath.Join(t.TempDir(), "policies.yaml"), WorkDir: t.TempDir(), LogLevel: "warn"}
	err = checkKveppConfigs(rc, baselines)
	if err == nil || !strings.Contains(err.Error(), `--baselines "kvepp:overlap_score_credit=abc": invalid DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT "abc"`) {
		t.Errorf("error %v, want the bad entry and kvepp's own message", err)
	}
	if err := checkKveppConfigs(rc, baselines[:2]); err != nil {
		t.Errorf("good settings refused: %v", err)
	}
	rc.KveppEnv = []string{"DYN_ROUTER_TEMPERATURE=abc"}
	if err := checkKveppConfigs(rc, baselines[:2]); err == nil || !strings.Contains(err.Error(), `the settings for every router (--kvepp-env, --log-level, --tokenizer-dir): invalid DYN_ROUTER_TEMPERATURE "abc"`) {
		t.Errorf("a bad --kvepp-env value: %v, want it blamed on the run-wide flags", err)
	}
}

func TestPolicyResolution(t *testing.T) {
	reg := catalog.Builtins()
	t.Run("every default baseline resolves through the catalog", func(t *testing.T) {
		o := defaultOptions()
		bs, err := o.baselines()
		if err != nil {
			t.Fatal(err)
		}
		var instances []string
		for _, b := range bs {
			instances = append(instances, b.Instance)
		}
		doc, err := policyConfig(policyInstances(bs))
		if err != nil {
			t.Fatal(err)
		}
		if err := validatePolicies(reg, doc, instances); err != nil {
			t.Fatal(err)
		}
		if err := checkBaselines(reg, bs); err != nil {
			t.Fatal(err)
		}
	})
}

func TestStubTokenizerLoads(t *testing.T) {
	dir, err := writeStubTokenizer(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatalf("kvepp cannot load the stub tokenizer: %v", err)
	}
	if got := tok.Encode("ab", false); len(got) != 2 {
		t.Fatalf("the stub encodes %q as %v, want one token per byte", "ab", got)
	}
}

// sampleResult is a two-baseline result for the output writers.
func sampleResult() *Result {
	tl := func(h float64) []TimelinePoint {
		return []TimelinePoint{{0, 3, h / 2, 0.5}, {10, 4, h, 0.6}, {20, 0, 0, 0}}
	}
	return &Result{
		Workload: WorkloadInfo{Name: "a <trace> & co", Requests: 7, SpanSeconds: 30, IdealHitRate: 0.6},
		Setup:    SetupInfo{Workers: 4, BlockSize: 16, CapacityBlocks: 1024, Speedup: 10},
		Baselines: []BaselineResult{
			{Name: "kvepp", Requests: 7, Completed: 7, HitRate: 0.55, OfIdeal: 0.55 / 0.6, TTFTms: Quantiles{P50: 120}, Timeline: tl(0.55)},
			{Name: "round-robin", Requests: 7, Completed: 7, HitRate: 0.2, OfIdeal: 0.2 / 0.6, TTFTms: Quantiles{P50: 900}, Timeline: tl(0.2)},
		},
	}
}

func TestRenderSVG(t *testing.T) {
	svg := renderSVG(sampleResult())
	dec := xml.NewDecoder(strings.NewReader(svg))
	elems := map[string]int{}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("the SVG is not well-formed XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok {
			elems[se.Name.Local]++
		}
	}
	if elems["svg"] != 1 || elems["rect"] < 5 || elems["polyline"] != 3 {
		t.Fatalf("elements %v: want one svg, bars and 3 lines (2 baselines + ideal)", elems)
	}
	for _, want := range []string{"a &lt;trace&gt; &amp; co", "kvepp", "round-robin", "ideal 60.0%"} {
		if !strings.Contains(svg, want) {
			t.Errorf("the SVG lacks %q", want)
		}
	}
	// A router with nothing completed gets "no data" in both bar panels, never a zero bar or NaN.
	res := sampleResult()
	res.Baselines = append(res.Baselines, BaselineResult{Name: "failed", Requests: 7, Errors: 7})
	svg = renderSVG(res)
	if strings.Count(svg, ">no data<") != 2 || strings.Contains(svg, "NaN") {
		t.Errorf("a router without figures: want two \"no data\" labels and no NaN:\n%s", svg)
	}
	if got := describe(res.Baselines[2]); got != "failed: no request completed, errors 7" {
		t.Errorf("describe = %q", got)
	}
}

func TestWriteTable(t *testing.T) {
	var b bytes.Buffer
	res := sampleResult()
	res.Baselines = append(res.Baselines, BaselineResult{Name: "least-busy:min_device_overlap_blocks=2", Requests: 7, Errors: 7})
	writeTable(&b, res)
	out := b.String()
	for _, want := range []string{"| least-busy:min_device_overlap_blocks=2 | — | — | — |", "| router | hit rate |", "| kvepp | 55.0 % | 92 % | 120 ms |", "| round-robin | 20.0 % | 33 % | 900 ms |", "Ideal reuse (unbounded single cache): 60.0 % of prompt tokens; one cache of the pool's total capacity: 0.0 % with LRU eviction"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestProcCPU(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	before, ok := procCPU(os.Getpid())
	if !ok {
		t.Fatal("cannot read this process's CPU time")
	}
	deadline := time.Now().Add(60 * time.Millisecond)
	x := 0
	for time.Now().Before(deadline) {
		x++
	}
	after, _ := procCPU(os.Getpid())
	if after < before || x == 0 {
		t.Fatalf("CPU time went from %v to %v", before, after)
	}
}

func TestWriteJSON(t *testing.T) {
	dir := t.TempDir()
	res := sampleResult()
	if err := writeJSON(filepath.Join(dir, "r.json"), res); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, "r.json"))
	if err != nil || !bytes.Contains(data, []byte(`"fraction_of_ideal"`)) {
		t.Fatalf("result.json: %v %s", err, data)
	}
}

func TestFailedRequestsAreWarnedAbout(t *testing.T) {
	res := &Result{Workload: WorkloadInfo{Requests: 20, SpanSeconds: 10}, Baselines: []BaselineResult{
		{Name: "kvepp:x=1", Requests: 20, Errors: 20},
		{Name: "round-robin", Requests: 20, Completed: 20, RequestsPerSecond: 2, TTFTms: Quantiles{P50: 100}, QueueMs: Quantiles{P50: 1}, E2Ems: Quantiles{P50: 200}},
	}}
	w := saturationWarnings(res)
	if len(w) != 1 || !strings.Contains(w[0], `router "kvepp:x=1": 20 of 20 requests failed`) || !strings.Contains(w[0], "work/requests-"+fileSlug("kvepp:x=1")+".csv") || !strings.Contains(w[0], "no figures") {
		t.Errorf("warnings %q, want one about kvepp:x=1's failed requests", w)
	}
}

func TestKveppLogWarningsQuoteTheLastWarnings(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "kvepp.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := &kveppProcess{log: f}
	if got := p.logWarnings(); got != "" {
		t.Errorf("empty log: %q", got)
	}
	for _, l := range []string{`{"level":"info","message":"a"}`, `{"level":"warn","message":"w1"}`, `{"level":"error","message":"e1"}`,
		`{"level":"warn","message":"w2"}`, `{"level":"warn","message":"w3"}`} {
		fmt.Fprintln(f, l)
	}
	want := `; kvepp log: {"level":"error","message":"e1"} | {"level":"warn","message":"w2"} | {"level":"warn","message":"w3"}`
	if got := p.logWarnings(); got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestStreamedChoiceIsFixedPerRequest(t *testing.T) {
	n, both := 0, 0
	for i := 0; i < 2000; i++ {
		id := fmt.Sprintf("r%06d", i)
		a := streamed(id, 1, 0.3)
		if a != streamed(id, 1, 0.3) {
			t.Fatal("the choice is not deterministic")
		}
		if a {
			n++
		}
		if streamed(id, 1, 1) && !streamed(id, 1, 0) {
			both++
		}
	}
	if n < 520 || n > 680 || both != 2000 {
		t.Fatalf("%d of 2000 streamed at 0.3 (want ≈ 600), %d at the extremes", n, both)
	}
}

// TestVirtualReplay runs the default policy, the built-in cost and round-robin through a short
// virtual replay on each engine model: deterministic, every request completed, and kvepp's
// cache-aware routing ahead of round-robin on hit rate.
func TestVirtualReplay(t *testing.T) {
	for _, engine := range []string{"vllm", "simple"} {
		t.Run("engine "+engine, func(t *testing.T) {
			o, err := parseFlags([]string{"--virtual", "--engine", engine, "--limit", "150", "--baselines", "kvepp,kvepp-dynamo,round-robin", "--stream", "0.5", "--out", t.TempDir()}, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			run := func() *Result {
				res, err := Run(t.Context(), o, nil, false)
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			a, b := run(), run()
			for i, br := range a.Baselines {
				if br.Completed != 150 || br.Errors != 0 {
					t.Fatalf("%s: %d completed, %d errors: %v", br.Name, br.Completed, br.Errors, br.FirstErrors)
				}
				if br.HitRate != b.Baselines[i].HitRate || br.TTFTms != b.Baselines[i].TTFTms {
					t.Fatalf("%s: two runs differ: %+v vs %+v", br.Name, br.TTFTms, b.Baselines[i].TTFTms)
				}
				if br.TTFTStreamedMs == nil || br.TTFTNonStreamedMs == nil || br.ITLms.P50 <= 0 || br.E2Ems.P50 <= br.TTFTms.P50 {
					t.Fatalf("%s: latency figures missing: %+v", br.Name, br)
				}
			}
			if kv, rr := a.Baselines[0], a.Baselines[2]; kv.HitRate <= rr.HitRate {
				t.Fatalf("kvepp hit %.3f ≤ round-robin %.3f", kv.HitRate, rr.HitRate)
			}
			if !a.Setup.Virtual || a.Setup.Engine != engine {
				t.Fatalf("setup %+v", a.Setup)
			}
			if p := a.Setup.Profile; engine == "vllm" && (p == nil || p.Name != "llama-3.1-8b-a100-80gb") {
				t.Fatalf("setup profile %+v", p)
			}
		})
	}
}

func TestMachineWarning(t *testing.T) {
	b := BaselineResult{Name: "r", MakespanSeconds: 100, EngineLagSeconds: 8 * 4}
	if w := machineWarning(b, 8); w != "" {
		t.Fatalf("4 %% lost: %q", w)
	}
	b.EngineLagSeconds = 8 * 30
	if w := machineWarning(b, 8); !strings.Contains(w, "lost 30 %") {
		t.Fatalf("30 %% lost: %q", w)
	}
}

// TestAssumedPrefillRateIsScaledBySpeedup: kvepp runs on the wall clock while the pool's clock
// runs --speedup times faster, so the assumed prefill rate kvepp gets is 10,000 tokens per
// simulated second in wall-clock tokens/s; a value a router gives replaces it.
func TestAssumedPrefillRateIsScaledBySpeedup(t *testing.T) {
	rc := RunConfig{Speedup: 10, Sim: SimConfig{BlockSize: 16}, KveppEnv: []string{"DYN_ROUTER_TEMPERATURE=0"}}
	last := func(env []string) string {
		v := ""
		for _, kv := range env {
			if name, val, _ := strings.Cut(kv, "="); name == "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND" {
				v = val
			}
		}
		return v
	}
	if got := last(rc.kveppSpecFor(Baseline{Name: "kvepp"}, "w.yaml").environ()); got != "100000" {
		t.Errorf("assumed rate %q, want 100000 (10,000 × speedup 10)", got)
	}
	b := Baseline{Name: "kvepp:x", Env: []string{"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=0"}}
	if got := last(rc.kveppSpecFor(b, "w.yaml").environ()); got != "0" {
		t.Errorf("assumed rate %q, want the router's 0", got)
	}
	if ttl := rc.kveppSpecFor(Baseline{Name: "kvepp"}, "w.yaml").ApproxTTL; ttl != 12*time.Second {
		t.Errorf("approximate TTL %v, want 120 s / speedup 10", ttl)
	}

	// A virtual replay's kvepp reads the simulated clock itself: nothing is scaled (scaled, every
	// non-streamed prefill was released 10× too early and the policy saw 10× faster prefills).
	rc.Virtual = true
	if got := last(rc.kveppSpecFor(Baseline{Name: "kvepp"}, "w.yaml").environ()); got != "10000" {
		t.Errorf("virtual: assumed rate %q, want 10000 (kvepp's clock is the simulated one)", got)
	}
	if ttl := rc.kveppSpecFor(Baseline{Name: "kvepp"}, "w.yaml").ApproxTTL; ttl != 120*time.Second {
		t.Errorf("virtual: approximate TTL %v, want 120 s", ttl)
	}
}
