package runner

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/catalog"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

// TestTheEPPRunsPredictedTTFTAndSelectServiceTheBuiltInCost checks what each mode runs when
// nothing selects a policy, and that DYN_ROUTER_WORKER_SELECTION_POLICY=default gives the EPP the
// built-in dynamo-default-cost-fn.
func TestTheEPPRunsPredictedTTFTAndSelectServiceTheBuiltInCost(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	resolved := func(t *testing.T, cfg Config) string {
		t.Helper()
		var buf bytes.Buffer
		if _, err := pickerConfig(cfg, catalog.Builtins(), zerolog.New(&buf)); err != nil {
			t.Fatal(err)
		}
		return buf.String()
	}
	t.Run("the EPP runs predicted-ttft out of the box", func(t *testing.T) {
		cfg, err := LoadConfig([]string{tok}, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if log := resolved(t, cfg); !strings.Contains(log, `"policy":"predicted-ttft","type":"predicted-ttft","selected_by":"host default"`) {
			t.Fatalf("resolution log %s", log)
		}
	})
	t.Run("the default policy assumes DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND for unmeasured workers", func(t *testing.T) {
		for env, want := range map[string]string{
			"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=25000": `"params":{"prefill_tokens_per_second":25000}`,
			"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=0":     `"selected_by":"host default","message"`,
		} {
			cfg, err := LoadConfig([]string{tok, env}, nil, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if log := resolved(t, cfg); !strings.Contains(log, want) {
				t.Fatalf("%s: resolution log %s, want %s", env, log, want)
			}
		}
	})
	t.Run("DYN_ROUTER_WORKER_SELECTION_POLICY=default gives the EPP the built-in cost", func(t *testing.T) {
		cfg, err := LoadConfig([]string{tok, "DYN_ROUTER_WORKER_SELECTION_POLICY=default"}, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if log := resolved(t, cfg); !strings.Contains(log, `"policy":"default","type":"dynamo-default-cost-fn"`) {
			t.Fatalf("resolution log %s", log)
		}
	})
	t.Run("epp select-service keeps the documented built-in default", func(t *testing.T) {
		cfg, err := LoadSelectServiceConfig(nil)
		if err != nil {
			t.Fatal(err)
		}
		if log := resolved(t, cfg); !strings.Contains(log, `"policy":"default","type":"dynamo-default-cost-fn","selected_by":"built-in default"`) {
			t.Fatalf("resolution log %s", log)
		}
	})
}

// TestPrefillCompletionEstimateSettings checks DYN_EPP_ESTIMATE_PREFILL_COMPLETION,
// DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND and DYN_EPP_PREFILL_ATTENTION_TOKENS: their defaults, values reaching the picker, and bad
// values refused with the setting's name.
func TestPrefillCompletionEstimateSettings(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	for _, tc := range []struct {
		env       string // "" = defaults
		estimate  bool
		rate      float64
		attention float64
	}{
		{"", true, picker.DefaultAssumedPrefillTokensPerSecond, picker.DefaultPrefillAttentionTokens},
		{"DYN_EPP_ESTIMATE_PREFILL_COMPLETION=false", false, picker.DefaultAssumedPrefillTokensPerSecond, picker.DefaultPrefillAttentionTokens},
		{"DYN_EPP_ESTIMATE_PREFILL_COMPLETION=yes", true, picker.DefaultAssumedPrefillTokensPerSecond, picker.DefaultPrefillAttentionTokens},
		{"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=0", true, 0, picker.DefaultPrefillAttentionTokens},
		{"DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=25000", true, 25000, picker.DefaultPrefillAttentionTokens},
		{"DYN_EPP_PREFILL_ATTENTION_TOKENS=0", true, picker.DefaultAssumedPrefillTokensPerSecond, 0},
		{"DYN_EPP_PREFILL_ATTENTION_TOKENS=64000", true, picker.DefaultAssumedPrefillTokensPerSecond, 64000},
	} {
		env := []string{tok}
		if tc.env != "" {
			env = append(env, tc.env)
		}
		cfg, err := LoadConfig(env, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		pc, err := pickerConfig(cfg, catalog.Builtins(), zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		if pc.EstimatePrefillCompletion != tc.estimate || pc.AssumedPrefillTokensPerSecond != tc.rate || pc.PrefillAttentionTokens != tc.attention {
			t.Errorf("%q: EstimatePrefillCompletion %v, AssumedPrefillTokensPerSecond %v, PrefillAttentionTokens %v; want %v, %v, %v",
				tc.env, pc.EstimatePrefillCompletion, pc.AssumedPrefillTokensPerSecond, pc.PrefillAttentionTokens, tc.estimate, tc.rate, tc.attention)
		}
	}
	for _, bad := range []string{"DYN_EPP_ESTIMATE_PREFILL_COMPLETION=sometimes", "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=-1", "DYN_EPP_PREFILL_ATTENTION_TOKENS=-1", "DYN_EPP_PREFILL_ATTENTION_TOKENS=NaN"} {
		_, err := LoadConfig([]string{tok, bad}, nil, io.Discard)
		if name, _, _ := strings.Cut(bad, "="); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v, want an error naming the setting", bad, err)
		}
	}
}
