package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/policies/predictedttft"
)

func TestPolicyFlagParsing(t *testing.T) {
	type want struct{ name, instance, typ, params string }
	cases := []struct {
		name    string
		args    []string
		want    []want // the routers after the default baselines
		wantErr string
	}{
		{"a parameterless policy is an instance named after its type", []string{"--policies", "least-busy"},
			[]want{{"least-busy", "least-busy", "least-busy", ""}}, ""},
		{"parameters after a colon become the instance's parameters", []string{"--policies", "least-busy:min_device_overlap_blocks=2"},
			[]want{{"least-busy:min_device_overlap_blocks=2", "least-busy-p1", "least-busy", `{"min_device_overlap_blocks":2}`}}, ""},
		{"values are YAML scalars and commas continue the parameters", []string{"--policies", "x:a=1.5,b=true,c=hello,d='7',e=,round-robin"},
			[]want{{"x:a=1.5,b=true,c=hello,d='7',e=", "x-p1", "x", `{"a":1.5,"b":true,"c":"hello","d":"7","e":null}`}}, ""},
		{"two parameter sets of one type are two routers", []string{"--policies", "least-busy:min_device_overlap_blocks=0, least-busy:min_device_overlap_blocks=4"},
			[]want{{"least-busy:min_device_overlap_blocks=0", "least-busy-p1", "least-busy", `{"min_device_overlap_blocks":0}`},
				{"least-busy:min_device_overlap_blocks=4", "least-busy-p2", "least-busy", `{"min_device_overlap_blocks":4}`}}, ""},
		{"parameters without a name are refused", []string{"--policies", "a=1"}, nil, `--policies "a=1": parameters need a policy name first`},
		{"an empty key is refused", []string{"--policies", "least-busy:=1"}, nil, `--policies "least-busy:=1": want key=value`},
		{"a repeated key is refused", []string{"--policies", "least-busy:a=1,a=2"}, nil, `parameter "a" given twice`},
		{"a NaN value is refused as not finite", []string{"--policies", "predicted-ttft:sticky_weight=.nan"}, nil,
			`--policies "predicted-ttft:sticky_weight=.nan": parameter "sticky_weight": value ".nan" is not a finite number`},
		{"an infinite value is refused as not finite", []string{"--policies", "predicted-ttft:sticky_kv_fraction=-.inf"}, nil, `value "-.inf" is not a finite number`},
		{"a structured value is refused", []string{"--policies", "least-busy:a={b: 1}"}, nil, `is not a scalar`},
		{"kvepp takes only kvepp settings as parameters", []string{"--baselines", "kvepp:x=1"}, nil, `--baselines "kvepp:x=1": "x" is not a kvepp setting`},
		{"default names the flag it came from", []string{"--baselines", "kvepp,default"}, nil, `--baselines "default": use "kvepp"`},
	}
	nDefault := len(strings.Split(defaultBaselines, ","))
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseFlags(tc.args, io.Discard)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			bs, err := o.baselines()
			if err != nil {
				t.Fatal(err)
			}
			if len(bs) != nDefault+len(tc.want) {
				t.Fatalf("baselines %+v, want the %d defaults and %d more", bs, nDefault, len(tc.want))
			}
			for i, w := range tc.want {
				b := bs[nDefault+i]
				if b.Name != w.name || b.Instance != w.instance || b.Type != w.typ || string(b.Params) != w.params || !b.UseKVEvents {
					t.Errorf("baseline %d = %+v (params %s), want %+v", i, b, b.Params, w)
				}
			}
		})
	}
}

// resolveEach generates the policy YAML of o's routers as Run does and resolves every router's
// instance through catalog.Resolve with the built-in registry, as kvepp will.
func resolveEach(t *testing.T, o Options) ([]Baseline, []byte) {
	t.Helper()
	bs, err := o.baselines()
	if err != nil {
		t.Fatal(err)
	}
	reg := catalog.Builtins()
	if err := checkBaselines(reg, bs); err != nil {
		t.Fatal(err)
	}
	doc, err := policyConfig(policyInstances(bs))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := catalog.ParseConfig(doc)
	if err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
	for _, b := range bs {
		// As the kvepp process resolves it: the EPP's own default when nothing is selected.
		res, err := catalog.ResolveWithDefault(reg, cfg, b.Instance, predictedttft.TypeName)
		if err != nil {
			t.Fatalf("%s: %v\n%s", b.Name, err, doc)
		}
		want := b.Instance
		if want == "" {
			want = predictedttft.TypeName
		}
		if res.Name != want || (b.Type != "" && res.Type != b.Type) {
			t.Fatalf("%s resolved to %s (%s), want instance %s of type %s", b.Name, res.Name, res.Type, want, b.Type)
		}
	}
	return bs, doc
}

func TestPoliciesWithParametersResolve(t *testing.T) {
	o, err := parseFlags([]string{"--baselines", "kvepp,round-robin", "--policies", "least-busy:min_device_overlap_blocks=2"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, doc := resolveEach(t, o)
	if !bytes.Contains(doc, []byte("min_device_overlap_blocks: 2")) {
		t.Fatalf("generated YAML lacks the parameter:\n%s", doc)
	}
}

func TestPolicyConfigFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "p.yaml")
	yaml := "worker_selection:\n  default: lb0\n  instances:\n" +
		"    - {name: lb0, type: least-busy, parameters: {min_device_overlap_blocks: 0}}\n" +
		"    - {name: lb8, type: least-busy, parameters: {min_device_overlap_blocks: 8}}\n"
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	o, err := parseFlags([]string{"--baselines", "kvepp,least-busy:min_device_overlap_blocks=1", "--policy-config", path}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	bs, _ := resolveEach(t, o)
	var names []string
	for _, b := range bs {
		names = append(names, b.Name)
	}
	if got := strings.Join(names, ","); got != "kvepp,least-busy:min_device_overlap_blocks=1,lb0,lb8" {
		t.Fatalf("routers %s", got)
	}

	clash := filepath.Join(dir, "clash.yaml")
	if err := os.WriteFile(clash, []byte("worker_selection: {instances: [{name: round-robin, type: random}]}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = parseFlags([]string{"--policy-config", clash}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), `instance "round-robin": the name is already taken by --baselines "round-robin"`) {
		t.Fatalf("error %v", err)
	}
	_, err = parseFlags([]string{"--policy-config", filepath.Join(dir, "missing.yaml")}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--policy-config") {
		t.Fatalf("error %v", err)
	}
}

func TestPolicyErrorsNameTheEntry(t *testing.T) {
	reg := catalog.Builtins()
	registered := "registered: " + strings.Join(reg.Types(), ", ")
	cases := []struct {
		args []string
		want []string
	}{
		{[]string{"--policies", "no-such-policy"}, []string{`--policies "no-such-policy": unknown policy type "no-such-policy"; ` + registered}},
		{[]string{"--baselines", "kvepp,bogus:a=1"}, []string{`--baselines "bogus:a=1": unknown policy type "bogus"; registered:`}},
		{[]string{"--policies", "least-busy"}, []string{`--policies "least-busy": `, "min_device_overlap_blocks"}},
		{[]string{"--policies", "least-busy:min_device_overlap_blocks=-1"}, []string{`--policies "least-busy:min_device_overlap_blocks=-1": `, "min_device_overlap_blocks"}},
	}
	for _, tc := range cases {
		o, err := parseFlags(tc.args, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		bs, err := o.baselines()
		if err != nil {
			t.Fatal(err)
		}
		err = checkBaselines(reg, bs)
		if err == nil {
			t.Fatalf("%v: no error", tc.args)
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v: error %q lacks %q", tc.args, err, w)
			}
		}
		if strings.Contains(err.Error(), "instances[") || strings.Contains(err.Error(), "--baselines/--policies") {
			t.Errorf("%v: error %q points into the generated YAML", tc.args, err)
		}
	}
}

func TestSaturationWarning(t *testing.T) {
	wl := WorkloadInfo{Requests: 300, SpanSeconds: 100} // 3 req/s arrive
	healthy := BaselineResult{Name: "kvepp", Requests: 300, Completed: 300, RequestsPerSecond: 300 / 104.5,
		TTFTms: Quantiles{P50: 250}, QueueMs: Quantiles{P50: 25}, E2Ems: Quantiles{P50: 4400}}
	slow := BaselineResult{Name: "random", Requests: 300, Completed: 300, RequestsPerSecond: 1.5,
		TTFTms: Quantiles{P50: 900}, QueueMs: Quantiles{P50: 200}, E2Ems: Quantiles{P50: 5000}}
	queued := BaselineResult{Name: "round-robin", Requests: 300, Completed: 300, RequestsPerSecond: 2.9,
		TTFTms: Quantiles{P50: 8000}, QueueMs: Quantiles{P50: 7500}, E2Ems: Quantiles{P50: 12000}}
	cases := []struct {
		b    BaselineResult
		want []string // "" = no warning
	}{
		{healthy, nil},
		{slow, []string{`router "random"`, "completes 1.50 req/s while 3.00 req/s arrive", "--workers", "--limit", "--speedup"}},
		{queued, []string{`router "round-robin"`, "queue wait p50 7500 ms is 94 % of TTFT p50 8000 ms"}},
		{BaselineResult{Name: "none"}, nil},
	}
	for _, tc := range cases {
		got := saturationWarning(tc.b, wl)
		if (got == "") != (tc.want == nil) {
			t.Fatalf("%s: warning %q", tc.b.Name, got)
		}
		for _, w := range tc.want {
			if !strings.Contains(got, w) {
				t.Errorf("%s: warning %q lacks %q", tc.b.Name, got, w)
			}
		}
	}
	if strings.Contains(saturationWarning(queued, wl), "completes") {
		t.Errorf("round-robin keeps up with arrivals; only its queue should be reported")
	}

	res := &Result{Workload: wl, Baselines: []BaselineResult{healthy, slow, queued}}
	res.Warnings = saturationWarnings(res)
	if len(res.Warnings) != 2 {
		t.Fatalf("warnings %q, want random and round-robin", res.Warnings)
	}
	var b bytes.Buffer
	writeTable(&b, res)
	if !strings.Contains(b.String(), "**Warning:** router \"random\" saturated") {
		t.Errorf("the table lacks the warning:\n%s", b.String())
	}
	dir := t.TempDir()
	if err := writeJSON(filepath.Join(dir, "r.json"), res); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(filepath.Join(dir, "r.json"))
	if !bytes.Contains(data, []byte(`"warnings": [`)) {
		t.Errorf("result.json lacks the warnings")
	}
}

func TestParameterValuesMayHoldColons(t *testing.T) {
	entries, err := parsePolicyList("--policies", "least-busy:min_device_overlap_blocks=0,endpoint=http://h:1,round-robin")
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 2 || entries[0].Name != "least-busy" || entries[1].Name != "round-robin" {
		t.Fatalf("entries %+v, want least-busy with two parameters, then round-robin", entries)
	}
	var params map[string]any
	if err := json.Unmarshal(entries[0].Params, &params); err != nil || params["endpoint"] != "http://h:1" || params["min_device_overlap_blocks"] != float64(0) {
		t.Errorf("parameters %s (%v)", entries[0].Params, err)
	}
}
