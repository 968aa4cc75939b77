package runner

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/tokenizer"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

// TestTokenizeBudget: DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES admits bodies while their bytes fit; a
// request that does not fit waits, and ends with its own context or, after the wait, with a
// tokenizer timeout (504); a body larger than the budget takes all of it and runs alone; nil
// (0) admits everything.
func TestTokenizeBudget(t *testing.T) {
	b := newTokenizeBudget(100, 20*time.Millisecond)
	r1, err := b.acquire(context.Background(), 60)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := b.acquire(context.Background(), 40)
	if err != nil {
		t.Fatalf("40 more bytes fit in 100: %v", err)
	}
	// Full: a canceled request gets its own error, without waiting.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.acquire(ctx, 1); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled request: %v, want context.Canceled", err)
	}
	// Full for the whole wait: a timeout the ext_proc server answers 504.
	_, err = b.acquire(context.Background(), 1)
	if !errors.Is(err, extproc.ErrTokenizerTimeout) || extproc.ClassifyTokenizerError(err) != extproc.KindTokenizerTimeout {
		t.Fatalf("full budget: %v, want a tokenizer timeout", err)
	}
	r1()
	r2()
	// A body larger than the budget takes all of it and runs alone.
	big, err := b.acquire(context.Background(), 1000)
	if err != nil {
		t.Fatalf("a body over the budget must still run: %v", err)
	}
	if _, err := b.acquire(context.Background(), 1); !errors.Is(err, extproc.ErrTokenizerTimeout) {
		t.Fatalf("while a body over the budget runs: %v, want a timeout", err)
	}
	// A waiting request gets in as soon as room is released.
	done := make(chan error, 1)
	b.wait = time.Minute
	go func() {
		r, err := b.acquire(context.Background(), 50)
		if err == nil {
			r()
		}
		done <- err
	}()
	big()
	if err := <-done; err != nil {
		t.Fatalf("waiting request after release: %v", err)
	}
	var none *tokenizeBudget = newTokenizeBudget(0, time.Second)
	if none != nil {
		t.Fatal("0 bytes must mean unbounded (nil)")
	}
	if r, err := none.acquire(context.Background(), 1<<30); err != nil {
		t.Fatal(err)
	} else {
		r()
	}
}

// TestLocalTokenizerBudgetAndLongPieces: the ext_proc path of the local tokenizer waits on the
// budget (a full one times out), and a completion whose prompt has a piece over
// tokenizer.MaxExactPieceBytes routes with the ids from that piece on under a request-unique
// multimodal hash (uncached), like the text after an image.
func TestLocalTokenizerBudgetAndLongPieces(t *testing.T) {
	lt := qwenLocal(t)
	lt.budget = newTokenizeBudget(1<<20, 20*time.Millisecond)
	body := []byte(`{"model":"m","prompt":"Summarize: a` + strings.Repeat("z", tokenizer.MaxExactPieceBytes+1) + `b"}`)
	call := extproc.TokenizeCall{Kind: extproc.PromptCompletion, Body: body}
	p, err := lt.TokenizePrompt(context.Background(), call)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.MMItems) != 1 || p.MMItems[0].Start < 3 || p.MMItems[0].Start > 5 || p.MMItems[0].End != len(p.TokenIDs) {
		t.Fatalf("MMItems %+v of %d ids, want the ids from the long piece on booked as uncached", p.MMItems, len(p.TokenIDs))
	}
	hold, err := lt.budget.acquire(context.Background(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer hold()
	if _, err := lt.TokenizePrompt(context.Background(), call); !errors.Is(err, extproc.ErrTokenizerTimeout) {
		t.Fatalf("full budget: %v, want a tokenizer timeout", err)
	}
}

// TestPromptTokenLimitsAgree: the tokenizer stops encoding at the picker's token_ids limit, so a
// locally tokenized prompt is refused by the same bound, early.
func TestPromptTokenLimitsAgree(t *testing.T) {
	if tokenizer.MaxPromptTokens != picker.MaxISLTokens {
		t.Fatalf("tokenizer.MaxPromptTokens %d != picker.MaxISLTokens %d", tokenizer.MaxPromptTokens, picker.MaxISLTokens)
	}
}

// TestTokenizeMaxInflightBytesSetting: DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES defaults to 64 MiB, is
// read from the environment, and a negative value is refused with the setting's name.
func TestTokenizeMaxInflightBytesSetting(t *testing.T) {
	env := []string{"DYN_ROUTER_USE_KV_EVENTS=false"}
	cfg, err := LoadConfig(env, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.TokenizeMaxInflightBytes != 64<<20 {
		t.Fatalf("default %d, want 64 MiB", cfg.TokenizeMaxInflightBytes)
	}
	cfg, err = LoadConfig(append(env, "DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES=1000"), nil, nil)
	if err != nil || cfg.TokenizeMaxInflightBytes != 1000 {
		t.Fatalf("from the environment: %d, %v", cfg.TokenizeMaxInflightBytes, err)
	}
	cfg.TokenizeMaxInflightBytes = -1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES") {
		t.Fatalf("negative budget: %v", err)
	}
}

// TestLoadTokenizersSharesTheBudget: every local tokenizer loaded gets the one budget of
// DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES, waiting up to DYN_EPP_TOKENIZATION_TIMEOUT_MS.
func TestLoadTokenizersSharesTheBudget(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TokenizerProtocol = TokenizerProtocolLocal
	cfg.TokenizerDir = sharedtest.Qwen3TokenizerDir(t)
	cfg.TokenizeMaxInflightBytes = 12345
	set, err := loadTokenizers(cfg, *testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	lt, ok := set.def.(localTokenizer)
	if !ok || lt.budget == nil || lt.budget.max != 12345 || lt.budget.wait != cfg.TokenizationTimeout.Duration() {
		t.Fatalf("local tokenizer budget %+v", lt.budget)
	}
}

// TestTokenizeBudgetSmallBodiesOvertakeWaiters (audit 8 finding 2): a body that fits in the free
// room gets in at once while a larger one waits (a strict FIFO made a 300-byte chat wait behind a
// waiting 32 MB body and time out with it); the waiter gets in when room is released; the 504
// names the bytes in flight; the counters see the waits and timeouts.
func TestTokenizeBudgetSmallBodiesOvertakeWaiters(t *testing.T) {
	b := newTokenizeBudget(100, time.Minute)
	b.stats = &budgetStats{}
	held, err := b.acquire(context.Background(), 60)
	if err != nil {
		t.Fatal(err)
	}
	bigDone := make(chan error, 1)
	go func() {
		r, err := b.acquire(context.Background(), 80)
		if err == nil {
			r()
		}
		bigDone <- err
	}()
	for b.stats.waits.Load() == 0 {
		runtime.Gosched() // until the large body waits
	}
	small, err := b.acquire(context.Background(), 30)
	if err != nil {
		t.Fatalf("30 bytes fit beside 60 of 100 while an 80-byte body waits: %v", err)
	}
	if got := b.stats.inFlight.Load(); got != 90 {
		t.Fatalf("in flight %d, want 90", got)
	}
	small()
	small() // releasing twice gives the bytes back once
	if got := b.stats.inFlight.Load(); got != 60 {
		t.Fatalf("in flight %d after the small body, want 60", got)
	}
	short := newTokenizeBudget(100, time.Millisecond)
	short.stats = &budgetStats{}
	r, err := short.acquire(context.Background(), 60)
	if err != nil {
		t.Fatal(err)
	}
	_, err = short.acquire(context.Background(), 50)
	if !errors.Is(err, extproc.ErrTokenizerTimeout) || !strings.Contains(err.Error(), "60 bytes of request bodies were being tokenized and 50 more did not fit") {
		t.Fatalf("timeout: %v, want one naming the 60 bytes in flight", err)
	}
	if short.stats.timeouts.Load() != 1 || short.stats.waits.Load() != 1 {
		t.Fatalf("timeouts %d waits %d, want 1 and 1", short.stats.timeouts.Load(), short.stats.waits.Load())
	}
	r()
	held()
	if err := <-bigDone; err != nil {
		t.Fatalf("the waiting body after release: %v", err)
	}
	if got := b.stats.inFlight.Load(); got != 0 {
		t.Fatalf("in flight %d after every release, want 0", got)
	}
}

// TestLocalTokenizerStopsWhenTheRequestEnds (audit 8 finding 3): a request whose context ends
// while it is tokenized gets its context's error (the ext_proc stream counts it as cancelled,
// not success) and gives its budget share back.
func TestLocalTokenizerStopsWhenTheRequestEnds(t *testing.T) {
	lt := qwenLocal(t)
	lt.budget = newTokenizeBudget(8<<20, time.Minute)
	lt.budget.stats = &budgetStats{}
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("the quick brown fox jumps over the lazy dog ", 1<<15) + `"}`)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := lt.TokenizePrompt(ctx, extproc.TokenizeCall{Kind: extproc.PromptCompletion, Body: body})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("TokenizePrompt after the request ended: %v, want context.Canceled", err)
	}
	if got := lt.budget.stats.inFlight.Load(); got != 0 {
		t.Fatalf("%d bytes still in flight", got)
	}
}

// TestDetokenizeCountsAgainstTheBudget (audit 8 finding 7): /detokenize builds its answer in
// memory (up to ~18× the body: Qwen3's longest token is 128 characters), so it waits for
// DYN_EPP_TOKENIZE_MAX_INFLIGHT_BYTES weighted by the body and the ids' spellings; a full budget
// answers 503 as /tokenize does.
func TestDetokenizeCountsAgainstTheBudget(t *testing.T) {
	budget := newTokenizeBudget(1<<20, 10*time.Millisecond)
	budget.stats = &budgetStats{}
	srv := tokenizeServer(t, func(_ *Config, set *tokenizerSet) {
		lt := set.def.(localTokenizer)
		lt.budget = budget
		set.def = lt
	})
	body := `{"tokens":[9707,1879]}`
	if code, out := post(t, srv.URL+"/detokenize", body); code != 200 {
		t.Fatalf("%d %s", code, out)
	}
	hold, err := budget.acquire(context.Background(), 1<<20-4) // 4 bytes left: less than the request
	if err != nil {
		t.Fatal(err)
	}
	defer hold()
	code, out := post(t, srv.URL+"/detokenize", body)
	if code != 503 || !strings.Contains(out, "the local tokenizer is busy") {
		t.Fatalf("full budget: %d %s, want 503 naming the budget", code, out)
	}
}
