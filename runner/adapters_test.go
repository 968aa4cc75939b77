package runner

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"

	"github.com/kvepp/kvepp/extproc"
	"github.com/kvepp/kvepp/extproc/extproctest"
	"github.com/kvepp/kvepp/internal/sharedtest"
	"github.com/kvepp/kvepp/picker"
)

func TestByteTokenizer(t *testing.T) {
	ids := func(s string) []uint32 { return bytesToIDs(nil, []byte(s)) }
	tests := []struct {
		name string
		fn   func(byteTokenizer, []byte) ([]uint32, error)
		body string
		want []uint32
	}{
		{"a chat prompt is the bytes of its messages array", byteTokenizer.TokenizeChat,
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, ids(`[{"role":"user","content":"hi"}]`)},
		{"a string completion prompt is its text", byteTokenizer.TokenizeCompletion,
			`{"prompt":"abc"}`, ids("abc")},
		{"a list completion prompt is its JSON text", byteTokenizer.TokenizeCompletion,
			`{"prompt":["a","b"]}`, ids(`["a","b"]`)},
		{"a responses prompt is instructions followed by input", byteTokenizer.TokenizeResponses,
			`{"instructions":"be brief","input":"hello"}`, ids(`"be brief""hello"`)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.fn(byteTokenizer{}, []byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Fatalf("ids (-want +got):\n%s", diff)
			}
		})
	}
	t.Run("a body that is not JSON is a tokenizer bad request", func(t *testing.T) {
		_, err := byteTokenizer{}.TokenizeChat([]byte("{"))
		if !errors.Is(err, extproc.ErrTokenizerBadRequest) {
			t.Fatalf("error = %v", err)
		}
	})
	t.Run("a conversation that grows keeps the earlier turns as a byte prefix", func(t *testing.T) {
		a, _ := byteTokenizer{}.TokenizeChat([]byte(`{"messages":[{"role":"user","content":"q1"}]}`))
		b, _ := byteTokenizer{}.TokenizeChat([]byte(`{"messages":[{"role":"user","content":"q1"},{"role":"assistant","content":"a1"}]}`))
		if !cmp.Equal(a[:len(a)-1], b[:len(a)-1]) {
			t.Fatal("no shared prefix")
		}
	})
}

func TestTokenizerSet(t *testing.T) {
	def, other := byteTokenizer{}, &countingTokenizer{}
	tests := []struct {
		name    string
		set     *tokenizerSet
		model   string
		want    extproc.RequestTokenizer
		wantErr string
	}{
		{"a model listed in DYN_EPP_TOKENIZERS gets its own tokenizer", &tokenizerSet{byModel: map[string]extproc.RequestTokenizer{"a": other}, def: def}, "a", other, ""},
		{"another model gets the default tokenizer", &tokenizerSet{byModel: map[string]extproc.RequestTokenizer{"a": other}, def: def}, "b", def, ""},
		{"without a default an unlisted model is an internal error", &tokenizerSet{byModel: map[string]extproc.RequestTokenizer{"a": other}}, "b", nil, `no tokenizer is configured for model "b"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.set.ForModel(tc.model)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || picker.KindOf(err) != picker.KindInternal {
					t.Fatalf("error = %v (kind %q)", err, picker.KindOf(err))
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %v, %v", got, err)
			}
		})
	}
}

// countingTokenizer is a distinct RequestTokenizer value for identity checks.
type countingTokenizer struct{ n int }

func (c *countingTokenizer) TokenizeChat([]byte) ([]uint32, error) { c.n++; return []uint32{1}, nil }
func (c *countingTokenizer) TokenizeCompletion([]byte) ([]uint32, error) {
	c.n++
	return []uint32{1}, nil
}
func (c *countingTokenizer) TokenizeResponses([]byte) ([]uint32, error) {
	c.n++
	return []uint32{1}, nil
}

func TestTokenizersAreLoadedOncePerDirectory(t *testing.T) {
	dir := sharedtest.Qwen3TokenizerDir(t)
	cfg := DefaultConfig()
	cfg.TokenizerDir = dir
	cfg.Tokenizers = ModelDirs{"a": dir, "b": dir + "/"}
	set, err := loadTokenizers(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if set.byModel["a"] != set.def || set.byModel["b"] != set.def {
		t.Fatal("one directory was loaded more than once")
	}
	again, err := loadTokenizers(cfg, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if again.def.(localTokenizer).Tokenizer != set.def.(localTokenizer).Tokenizer {
		t.Fatal("a second Start loaded the unchanged directory again")
	}
}

func TestApproximateModeWithoutATokenizerKeepsConversationsTogether(t *testing.T) {
	cfg := loopbackConfig(t)
	cfg.TokenizerDir = ""
	cfg.UseKVEvents = false
	inst := startInstance(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for id := uint64(1); id <= 4; id++ {
		bs := uint32(16)
		rec := picker.WorkerRecord{WorkerID: id, ModelName: "m", Endpoint: "http://127.0.0.1:1810" + string(rune('0'+id)), BlockSize: &bs}
		if _, err := inst.Service.UpsertWorker(ctx, rec, picker.SourceAPI); err != nil {
			t.Fatal(err)
		}
	}
	client := extproctest.NewClient(dialPlain(t, inst.Addrs().GRPC))
	turn := `{"role":"user","content":"` + strings.Repeat("a long shared system context ", 40) + `"}`
	first := ""
	for i := 0; i < 5; i++ {
		body := `{"model":"m","messages":[` + turn + strings.Repeat(`,{"role":"user","content":"more"}`, i) + `]}`
		ex, err := client.Do(ctx, extproctest.Request{Body: []byte(body), Response: &extproctest.Response{Status: 200, Chunks: [][]byte{[]byte("{}")}}})
		if err != nil || ex.Immediate != nil {
			t.Fatalf("turn %d: err=%v immediate=%+v", i, err, ex.Immediate)
		}
		if first == "" {
			first = ex.Destination
		} else if ex.Destination != first {
			t.Fatalf("turn %d went to %s, turn 0 to %s", i, ex.Destination, first)
		}
	}
}
