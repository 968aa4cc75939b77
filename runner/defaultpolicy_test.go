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

func TestPrefillCompletionEstimateSetting(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	for _, tc := range []struct {
		env  []string
		want bool
	}{
		{[]string{tok}, true},
		{[]string{tok, "DYN_EPP_ESTIMATE_PREFILL_COMPLETION=false"}, false},
		{[]string{tok, "DYN_EPP_ESTIMATE_PREFILL_COMPLETION=yes"}, true},
	} {
		cfg, err := LoadConfig(tc.env, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		pc, err := pickerConfig(cfg, catalog.Builtins(), zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		if pc.EstimatePrefillCompletion != tc.want {
			t.Errorf("%v: EstimatePrefillCompletion %v, want %v", tc.env[1:], pc.EstimatePrefillCompletion, tc.want)
		}
	}
	_, err := LoadConfig([]string{tok, "DYN_EPP_ESTIMATE_PREFILL_COMPLETION=sometimes"}, nil, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "DYN_EPP_ESTIMATE_PREFILL_COMPLETION") {
		t.Fatalf("a bad value: %v, want an error naming the setting", err)
	}
}

func TestAssumedPrefillRateSetting(t *testing.T) {
	tok := "DYN_EPP_TOKENIZER_DIR=" + sharedtest.Qwen3TokenizerDir(t)
	for _, tc := range []struct {
		env  []string
		want float64
	}{
		{[]string{tok}, picker.DefaultAssumedPrefillTokensPerSecond},
		{[]string{tok, "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=0"}, 0},
		{[]string{tok, "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=25000"}, 25000},
	} {
		cfg, err := LoadConfig(tc.env, nil, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		pc, err := pickerConfig(cfg, catalog.Builtins(), zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		if pc.AssumedPrefillTokensPerSecond != tc.want {
			t.Errorf("%v: AssumedPrefillTokensPerSecond %v, want %v", tc.env[1:], pc.AssumedPrefillTokensPerSecond, tc.want)
		}
	}
	_, err := LoadConfig([]string{tok, "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND=-1"}, nil, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "DYN_EPP_ASSUMED_PREFILL_TOKENS_PER_SECOND") {
		t.Fatalf("a negative rate: %v, want an error naming the setting", err)
	}
}
