package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"

	yamlv3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/runner"
)

// policyEntry is one router named on the command line: a name (kvepp, kvepp-approx or a catalog
// policy type) with optional parameters, as written in flag (e.g. "--policies").
type policyEntry struct {
	Flag   string          // "--baselines" or "--policies"
	Text   string          // the entry as the user wrote it, e.g. "least-busy:min_device_overlap_blocks=2"
	Name   string          // the router or policy type name
	Params json.RawMessage // JSON object of the parameters; nil when none were given
	Raw    []string        // the parameters as written, "key=value" each (kvepp settings keep their text)
}

// source names the entry and the flag it came from, for error messages.
func (e policyEntry) source() string { return fmt.Sprintf("%s %q", e.Flag, e.Text) }

// parsePolicyList splits a --baselines/--policies value into entries. Each entry is
// name[:key=value[,key=value…]]; since entries are comma-separated too, a comma-separated piece
// that is key=value with no ':' before its '=' continues the parameters of the entry before it
// (so a value may hold ':', e.g. a URL), and any other piece starts a new entry. Policy parameter
// values are YAML scalars (2 → number, true → bool, "a b" or a → string); the settings of kvepp
// and kvepp-approx entries are kept exactly as written (see kveppSettings).
func parsePolicyList(flagName, list string) ([]policyEntry, error) {
	var out []policyEntry
	for _, piece := range strings.Split(list, ",") {
		piece = strings.TrimSpace(piece)
		if piece == "" {
			continue
		}
		name, param, hasParam := strings.Cut(piece, ":")
		if key, _, hasEq := strings.Cut(piece, "="); hasEq && !strings.Contains(key, ":") {
			if len(out) == 0 || out[len(out)-1].Params == nil {
				return nil, fmt.Errorf("%s %q: parameters need a policy name first: name:key=value[,key=value…]", flagName, piece)
			}
			e := &out[len(out)-1]
			e.Text += "," + piece
			e.Raw = append(e.Raw, piece)
			if isKvepp(e.Name) {
				continue
			}
			if err := addParam(e, piece); err != nil {
				return nil, err
			}
			continue
		}
		e := policyEntry{Flag: flagName, Text: piece, Name: strings.TrimSpace(name)}
		if e.Name == "" {
			return nil, fmt.Errorf("%s %q: missing policy name", flagName, piece)
		}
		if hasParam {
			e.Params = json.RawMessage("{}")
			e.Raw = []string{strings.TrimSpace(param)}
			if !isKvepp(e.Name) {
				if err := addParam(&e, param); err != nil {
					return nil, err
				}
			}
		}
		out = append(out, e)
	}
	return out, nil
}

// isKvepp reports whether name is one of the built-in routers, whose parameters are kvepp settings.
func isKvepp(name string) bool {
	return name == "kvepp" || name == "kvepp-approx" || name == dynamoRouter
}

// dynamoRouter is the router that runs kvepp with the spec's built-in cost
// (dynamo-default-cost-fn, selected as "default"); "kvepp" runs what the EPP runs out of the box.
const dynamoRouter = "kvepp-dynamo"

// kveppInstance is the worker_selection instance a built-in router selects: "" (nothing: the EPP's
// own default) for kvepp and kvepp-approx, "default" (the built-in cost) for kvepp-dynamo.
func kveppInstance(name string) string {
	if name == dynamoRouter {
		return catalog.DefaultName
	}
	return ""
}

// builtinInstance reports whether instance is one a built-in router selects, which the generated
// policy YAML does not define.
func builtinInstance(instance string) bool { return instance == "" || instance == catalog.DefaultName }

// addParam parses one key=value into e.Params.
func addParam(e *policyEntry, kv string) error {
	k, v, ok := strings.Cut(kv, "=")
	k = strings.TrimSpace(k)
	if !ok || k == "" {
		return fmt.Errorf("%s: want key=value after the policy name, got %q (commas separate routers and parameters, so a comma-list value needs --policy-config, or --kvepp-env for a kvepp setting)", e.source(), kv)
	}
	m := map[string]any{}
	if err := json.Unmarshal(e.Params, &m); err != nil {
		return err
	}
	if _, dup := m[k]; dup {
		return fmt.Errorf("%s: parameter %q given twice", e.source(), k)
	}
	var val any
	if err := yaml.Unmarshal([]byte(strings.TrimSpace(v)), &val); err != nil {
		// .nan and .inf are YAML floats, but the YAML-to-JSON conversion refuses them: say so.
		var f float64
		if yamlv3.Unmarshal([]byte(strings.TrimSpace(v)), &f) == nil && (math.IsNaN(f) || math.IsInf(f, 0)) {
			return fmt.Errorf("%s: parameter %q: value %q is not a finite number", e.source(), k, v)
		}
		return fmt.Errorf("%s: parameter %q: value %q is not a YAML scalar: %v", e.source(), k, v, err)
	}
	switch val.(type) {
	case map[string]any, []any:
		return fmt.Errorf("%s: parameter %q: value %q is not a scalar (use --policy-config for structured parameters)", e.source(), k, v)
	}
	m[k] = val
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	e.Params = data
	return nil
}

// paramInstanceName names the generated instance of the n-th (1-based) entry with parameters.
func paramInstanceName(typ string, n int) string {
	name := fmt.Sprintf("%s-p%d", typ, n)
	if !catalog.ValidName(name) {
		name = fmt.Sprintf("policy-p%d", n)
	}
	return name
}

// baselines expands --baselines, --policies and --policy-config into the routers to run.
func (o *Options) baselines() ([]Baseline, error) {
	var entries []policyEntry
	for _, f := range []struct{ flag, list string }{{"--baselines", o.Baselines}, {"--policies", o.Policies}} {
		es, err := parsePolicyList(f.flag, f.list)
		if err != nil {
			return nil, err
		}
		entries = append(entries, es...)
	}
	var out []Baseline
	seen := map[string]string{} // display name → source
	instances := map[string]bool{}
	nParam := 0
	for _, e := range entries {
		key := e.Name
		if e.Params != nil {
			key = e.Text
		}
		if seen[key] != "" {
			continue // the same router twice: run it once
		}
		seen[key] = e.source()
		switch {
		case e.Name == catalog.DefaultName:
			return nil, fmt.Errorf(`%s: use "kvepp" for what the EPP runs out of the box (with KV events), "kvepp-approx" (approximate mode) or "kvepp-dynamo" for the spec's built-in cost`, e.source())
		case isKvepp(e.Name):
			b := Baseline{Name: e.Name, Instance: kveppInstance(e.Name), UseKVEvents: e.Name != "kvepp-approx", Source: e.source()}
			if e.Params != nil {
				env, err := kveppSettings(e)
				if err != nil {
					return nil, err
				}
				b.Name, b.Env = e.Text, env
			}
			out = append(out, b)
		case e.Params == nil:
			out = append(out, Baseline{Name: e.Name, Instance: e.Name, Type: e.Name, UseKVEvents: true, Source: e.source()})
			instances[e.Name] = true
		default:
			nParam++
			b := Baseline{Name: e.Text, Instance: paramInstanceName(e.Name, nParam), Type: e.Name, Params: e.Params, UseKVEvents: true, Source: e.source()}
			out = append(out, b)
			instances[b.Instance] = true
		}
	}
	if o.PolicyConfig != "" {
		data, err := os.ReadFile(o.PolicyConfig)
		if err != nil {
			return nil, fmt.Errorf("--policy-config: %w", err)
		}
		cfg, err := catalog.ParseConfig(data)
		if err != nil {
			return nil, fmt.Errorf("--policy-config %s: %w", o.PolicyConfig, err)
		}
		if cfg.WorkerSelection == nil || len(cfg.WorkerSelection.Instances) == 0 {
			return nil, fmt.Errorf("--policy-config %s: no worker_selection.instances", o.PolicyConfig)
		}
		for _, in := range cfg.WorkerSelection.Instances {
			src := fmt.Sprintf("--policy-config %s instance %q", o.PolicyConfig, in.Name)
			if prev := seen[in.Name]; prev != "" || instances[in.Name] {
				if prev == "" {
					prev = "a generated instance"
				}
				return nil, fmt.Errorf("%s: the name is already taken by %s; rename the instance", src, prev)
			}
			seen[in.Name] = src
			instances[in.Name] = true
			out = append(out, Baseline{Name: in.Name, Instance: in.Name, Type: in.Type, Params: in.Parameters, UseKVEvents: true, Source: src})
		}
	}
	if len(out) == 0 {
		return nil, errors.New("--baselines, --policies and --policy-config name no router")
	}
	files := map[string]string{} // file name → router
	for _, b := range out {
		slug := fileSlug(b.Name)
		if prev, taken := files[slug]; taken {
			return nil, fmt.Errorf("%s and %q would share the result files work/*-%s.*; write them differently", b.Source, prev, slug)
		}
		files[slug] = b.Name
	}
	return out, nil
}

// policyInstances are the worker_selection instances of the non-built-in baselines.
func policyInstances(baselines []Baseline) []catalog.Instance {
	var out []catalog.Instance
	seen := map[string]bool{}
	for _, b := range baselines {
		if builtinInstance(b.Instance) || seen[b.Instance] {
			continue
		}
		seen[b.Instance] = true
		typ := b.Type
		if typ == "" {
			typ = b.Instance
		}
		out = append(out, catalog.Instance{Name: b.Instance, Type: typ, Parameters: b.Params})
	}
	return out
}

// checkBaselines resolves every baseline's instance through the catalog on its own, before
// anything starts, so a mistake is reported against the entry the user wrote and the flag it came
// from (not an index into the generated YAML), e.g.
// `--policies "no-such-policy": unknown policy type; registered: …`.
func checkBaselines(reg *catalog.Registry, baselines []Baseline) error {
	for _, b := range baselines {
		if builtinInstance(b.Instance) {
			continue
		}
		insts := policyInstances([]Baseline{b})
		if _, ok := reg.Lookup(insts[0].Type); !ok {
			return fmt.Errorf("%s: unknown policy type %q; registered: %s", b.Source, insts[0].Type, strings.Join(reg.Types(), ", "))
		}
		doc, err := policyConfig(insts)
		if err == nil {
			err = validatePolicies(reg, doc, []string{b.Instance})
		}
		if err != nil {
			msg := err.Error()
			const prefix = "policy config: worker_selection.instances["
			if i := strings.Index(msg, "): "); strings.HasPrefix(msg, prefix) && i >= 0 {
				msg = msg[i+len("): "):]
			}
			return fmt.Errorf("%s: %s", b.Source, msg)
		}
	}
	return nil
}

// kveppSettings turns the parameters of a kvepp or kvepp-approx entry into KEY=VALUE settings for
// that kvepp instance only, e.g. "kvepp:track_active_blocks=false,overlap_score_credit=6" →
// DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=6 and DYN_ROUTER_TRACK_ACTIVE_BLOCKS=false. Keys resolve as
// in resolveSetting; values pass on exactly as written (kvepp parses them), so 2097152 stays
// 2097152. Settings come out sorted by name, so a run is reproducible from its report.
func kveppSettings(e policyEntry) ([]string, error) {
	seen := map[string]string{} // canonical name → key as written
	var out []string
	for _, kv := range e.Raw {
		key, val, _ := strings.Cut(kv, "=")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		name, err := resolveSetting(key)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", e.source(), err)
		}
		if val == "" {
			// kvepp reads an empty value as unset, which would quietly drop a --kvepp-env value.
			return nil, fmt.Errorf("%s: %s needs a value: key=value", e.source(), key)
		}
		if prev, dup := seen[name]; dup {
			return nil, fmt.Errorf("%s: %s is given twice (as %q and %q)", e.source(), name, prev, key)
		}
		seen[name] = key
		out = append(out, name+"="+val)
	}
	slices.Sort(out)
	return out, nil
}

// resolveSetting maps a key written on the command line to the kvepp environment variable it
// sets: a DYN_… name or a documented alias (see the README's configuration table), or that name
// in lower case without its DYN_, DYN_ROUTER_ or DYN_ROUTER_KV_ prefix (track_active_blocks →
// DYN_ROUTER_TRACK_ACTIVE_BLOCKS). Aliases resolve to their canonical variable. It returns an
// error for unknown keys and for the settings eppbench sets itself (see benchOwnedSettings).
func resolveSetting(key string) (string, error) {
	k := strings.ToUpper(strings.ReplaceAll(key, "-", "_"))
	for _, cand := range []string{k, "DYN_" + k, "DYN_ROUTER_" + k, "DYN_ROUTER_KV_" + k} {
		name, ok := runner.CanonicalSettingName(cand)
		if !ok {
			continue
		}
		if hint, owned := benchOwnedSettings[name]; owned {
			return "", fmt.Errorf("%s is set by eppbench itself: %s", name, hint)
		}
		return name, nil
	}
	return "", fmt.Errorf("%q is not a kvepp setting; use a DYN_… name from the configuration table in README.md, or its lower-case form without the DYN_, DYN_ROUTER_ or DYN_ROUTER_KV_ prefix, e.g. track_active_blocks=false", key)
}
