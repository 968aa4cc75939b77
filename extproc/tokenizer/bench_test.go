package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvepp/kvepp/internal/sharedtest"
)

// cpuTime returns the process's user+system CPU time. The benchmarks report tokens per CPU
// second next to tokens per wall second because the shared 2-core machine is often
// oversubscribed, which inflates wall time but not CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func reportTokens(b *testing.B, tokens int, cpu0 time.Duration) {
	total := float64(tokens) * float64(b.N)
	b.ReportMetric(total/b.Elapsed().Seconds(), "tokens/s")
	if cpu := (cpuTime() - cpu0).Seconds(); cpu > 0 {
		b.ReportMetric(total/cpu, "tokens/cpu-s")
	}
}

func chatLongBody(b testing.TB) ([]byte, int) {
	b.Helper()
	for _, v := range sharedtest.RequestVectors(b) {
		if v.Name == "chat-long" {
			return v.Body, len(v.TokenIDs)
		}
	}
	b.Fatal("chat-long vector not found")
	return nil, 0
}

// BenchmarkTokenizeChatLong measures warm TokenizeChat (parse, render, encode) on the 3,011-token
// chat-long golden vector; the goal is ≥ 5 M tokens/s on one core.
func BenchmarkTokenizeChatLong(b *testing.B) {
	tk := qwen3(b)
	body, n := chatLongBody(b)
	if _, err := tk.TokenizeChat(body); err != nil { // warm the piece cache
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		ids, err := tk.TokenizeChat(body)
		if err != nil || len(ids) != n {
			b.Fatalf("TokenizeChat: %d ids, %v", len(ids), err)
		}
	}
	reportTokens(b, n, cpu0)
}

// BenchmarkEncodeChatLongPrompt isolates Encode of the rendered chat-long prompt (warm).
func BenchmarkEncodeChatLongPrompt(b *testing.B) {
	tk := qwen3(b)
	var prompt string
	var n int
	for _, v := range sharedtest.RequestVectors(b) {
		if v.Name == "chat-long" {
			prompt, n = v.RenderedPrompt, len(v.TokenIDs)
		}
	}
	tk.Encode(prompt, false)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		tk.Encode(prompt, false)
	}
	reportTokens(b, n, cpu0)
}

// BenchmarkLoad measures Load of the 11 MB Qwen3 tokenizer.json plus its config.
func BenchmarkLoad(b *testing.B) {
	dir := sharedtest.Qwen3TokenizerDir(b)
	b.ReportAllocs()
	cpu0 := cpuTime()
	for i := 0; i < b.N; i++ {
		if _, err := Load(dir); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric((cpuTime()-cpu0).Seconds()/float64(b.N)*1e3, "cpu-ms/op")
}

// spChatBody builds a chat of about want tokens from the chat-long vector's text: a system
// message and alternating user/assistant turns, so every family's template accepts it.
func spChatBody(b *testing.B, repeats int) []byte {
	b.Helper()
	var v struct {
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
	}
	body, _ := chatLongBody(b)
	if err := json.Unmarshal(body, &v); err != nil {
		b.Fatal(err)
	}
	text := v.Messages[len(v.Messages)-1].Content
	msgs := []map[string]string{{"role": "system", "content": v.Messages[0].Content}}
	for i := 0; i < repeats; i++ {
		if i > 0 {
			msgs = append(msgs, map[string]string{"role": "assistant", "content": "Noted."})
		}
		msgs = append(msgs, map[string]string{"role": "user", "content": text})
	}
	out, err := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	if err != nil {
		b.Fatal(err)
	}
	return out
}

// BenchmarkTokenizeChatFamilies measures warm TokenizeChat (parse, render, encode) per core for
// the SentencePiece layouts (Llama 2 with the Phi-3 template: Prepend+Replace normalizer, no
// pre-tokenizer; Gemma 3 with its own template: Replace normalizer, 262k vocabulary) beside the
// byte-level Qwen3, on a ~3k-token chat (1 copy of chat-long) and a ~50k-token chat (16
// copies). The SentencePiece tokenizers come from testdata/fetch_models.sh (skipped without).
// Goal: >= 10 M tokens/s.
func BenchmarkTokenizeChatFamilies(b *testing.B) {
	type family struct {
		name, model, template string
		special               map[string]string
	}
	fams := []family{
		{"qwen3-bytelevel", "", "", nil},
		{"llama2-sentencepiece", "llama2", "phi3.jinja", map[string]string{"bos_token": "<s>", "eos_token": "</s>"}},
		{"gemma3-sentencepiece", "gemma3", "gemma3.jinja", map[string]string{"bos_token": "<bos>", "eos_token": "<end_of_turn>"}},
	}
	for _, f := range fams {
		for _, size := range []struct {
			name    string
			repeats int
		}{{"3k", 1}, {"50k", 16}} {
			b.Run(f.name+"/"+size.name, func(b *testing.B) {
				var tk *Tokenizer
				if f.model == "" {
					tk = qwen3(b)
				} else {
					tk = realModel(b, f.model)
					src, err := os.ReadFile(filepath.Join("testdata", "templates", f.template))
					if err != nil {
						b.Fatal(err)
					}
					cfg := map[string]any{"chat_template": string(src)}
					for k, v := range f.special {
						cfg[k] = v
					}
					data, _ := json.Marshal(cfg)
					cc, err := parseChatConfig(data, nil)
					if err != nil {
						b.Fatal(err)
					}
					saved := tk.chat
					tk.chat = cc
					b.Cleanup(func() { tk.chat = saved })
				}
				body := spChatBody(b, size.repeats)
				ids, err := tk.TokenizeChat(body) // warm the piece cache
				if err != nil {
					b.Fatal(err)
				}
				n := len(ids)
				b.ReportAllocs()
				b.ResetTimer()
				cpu0 := cpuTime()
				for i := 0; i < b.N; i++ {
					if ids, err := tk.TokenizeChat(body); err != nil || len(ids) != n {
						b.Fatalf("TokenizeChat: %d ids, %v", len(ids), err)
					}
				}
				reportTokens(b, n, cpu0)
				b.ReportMetric(float64(n), "tokens/op")
			})
		}
	}
}
