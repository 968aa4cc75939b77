package main

import (
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestAbsurdFlagsFailAtParsing checks that NaN, infinite and overflowing values of the timing
// flags, --speedup and --conversations fail at flag parsing with a message naming the flag, before
// any replay runs.
func TestAbsurdFlagsFailAtParsing(t *testing.T) {
	for _, tc := range []struct{ args, want string }{
		{"--coalesce-ms NaN", "--coalesce-ms NaN must be a finite number"},
		{"--coalesce-ms Inf", "--coalesce-ms +Inf must be a finite number"},
		{"--engine simple --prefill-us-per-token NaN", "--prefill-us-per-token NaN"},
		{"--engine simple --decode-us-per-token 1e300", "--decode-us-per-token 1e+300"},
		{"--engine simple --prefill-overhead-ms 1e300", "--prefill-overhead-ms 1e+300"},
		{"--engine simple --prefill-overhead-ms -1", "--prefill-overhead-ms -1"},
		{"--speedup 1e308", "--speedup 1e+308 must be 0"},
		{"--speedup 1e-300", "--speedup 1e-300 must be 0"},
		{"--speedup Inf", "--speedup +Inf must be 0"},
		{"--conversations 20000", "--conversations 20000 must be ≤ 2000"},
	} {
		_, err := parseFlags(append(strings.Fields(tc.args), "--out", t.TempDir()), io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.args, err, tc.want)
		}
	}
}

// TestTraceTimestampsBeyondADurationAreRefused checks that a timestamp that would overflow a
// time.Duration (1e15 ms, 1e300) is refused with the line that holds it, and the largest accepted
// one parses to a positive arrival.
func TestTraceTimestampsBeyondADurationAreRefused(t *testing.T) {
	line := func(ts string) string {
		return `{"timestamp": ` + ts + `, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}` + "\n"
	}
	for _, ts := range []string{"1e15", "1e300", "9.3e12"} {
		_, err := parseTrace(strings.NewReader(line("0")+line(ts)), 0, 0, 1)
		if err == nil || !strings.Contains(err.Error(), "line 2: timestamp") {
			t.Errorf("timestamp %s: error %v, want one naming line 2", ts, err)
		}
	}
	w, err := parseTrace(strings.NewReader(line("0")+line("1e12")), 0, 0, 1)
	if err != nil || w.Requests[1].Arrival <= 0 {
		t.Fatalf("timestamp 1e12: %v, %+v", err, w)
	}
}

// TestPooledLRUReuseIsSizedByTheWorkload runs the pooled-LRU reference of a 3-request trace with
// a pool of 2^22 blocks (what --workers × --capacity-blocks reaches): it allocates for the
// trace's blocks, not for the pool's capacity.
func TestPooledLRUReuseIsSizedByTheWorkload(t *testing.T) {
	w, err := parseTrace(strings.NewReader(`{"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}
{"timestamp": 1, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}
{"timestamp": 2, "input_length": 1000, "output_length": 7, "hash_ids": [0, 2]}
`), 0, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	got := PooledLRUReuse(w, 16, 1<<22)
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > 1<<20 {
		t.Fatalf("PooledLRUReuse allocated %d bytes for 3 requests, want < 1 MiB", n)
	}
	if got[1] != 992 { // the second request hits its first 62 blocks (all but the last partial)
		t.Fatalf("reuse %v", got)
	}
}

// TestVirtualReplayDoesNotDependOnSpeedup checks README's claim: a virtual replay's figures,
// output tokens per second included, are the same at --speedup 1 and 1e6.
func TestVirtualReplayDoesNotDependOnSpeedup(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 1000, "output_length": 70, "hash_ids": [0, 1]}
{"timestamp": 500, "input_length": 1000, "output_length": 70, "hash_ids": [0, 1]}
{"timestamp": 900, "input_length": 1000, "output_length": 70, "hash_ids": [0, 2]}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	var tps []float64
	for _, sp := range []string{"1", "1e6"} {
		o, err := parseFlags([]string{"--virtual", "--trace", trace, "--baselines", "kvepp", "--speedup", sp, "--out", t.TempDir()}, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		res, err := Run(t.Context(), o, nil, false)
		if err != nil {
			t.Fatal(err)
		}
		tps = append(tps, res.Baselines[0].OutputTokensPerSec)
	}
	if tps[0] <= 0 || tps[0] != tps[1] {
		t.Fatalf("out tok/s %v at speedup 1 and 1e6, want equal and > 0", tps)
	}
}
