package enginesim

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
)

// StepProfile is the step-time curve and scheduler limits of the vLLM engine model
// ([EngineVLLM]): how long one forward pass (one scheduler step) takes as a function of what the
// step computes. A step that schedules P prefill tokens in chunks (chunk i: q_i new tokens after
// c_i tokens already in the sequence) and D decode requests with KV contexts k_j takes
//
//	StepMs + PerTokenUs·(P + D)/1e3 + AttentionPairNs·Σ_i q_i·(c_i + (q_i+1)/2)/1e6 + ContextTokenNs·Σ_j k_j/1e6   (ms)
//
// The first term is the floor of every pass (reading the weights, launching kernels), the second
// the linear layers, which are compute-bound once a step carries more than a few hundred tokens,
// the third prefill attention (causal within the chunk, full over the earlier context), the fourth
// decode attention, which is bound by reading each running request's KV cache. A profile is plain
// data: build your own for another model or GPU, or pick a preset by name with [ProfileByName].
type StepProfile struct {
	// Name identifies the profile in results ("llama-3.1-8b-a100-80gb").
	Name string `json:"name"`
	// Description says which model, GPU and figures the profile was calibrated to.
	Description string `json:"description"`
	// StepMs is the fixed time of every step, milliseconds.
	StepMs float64 `json:"step_ms"`
	// PerTokenUs is the time per scheduled token (prefill or decode), microseconds.
	PerTokenUs float64 `json:"per_token_us"`
	// AttentionPairNs is the prefill attention time per (new token, attended token) pair,
	// nanoseconds.
	AttentionPairNs float64 `json:"attention_pair_ns"`
	// ContextTokenNs is the decode attention time per KV-cache token a decoding request reads,
	// nanoseconds.
	ContextTokenNs float64 `json:"context_token_ns"`
	// MaxNumBatchedTokens is vLLM's max_num_batched_tokens: the token budget of one step, tokens.
	MaxNumBatchedTokens int `json:"max_num_batched_tokens"`
	// MaxNumSeqs is vLLM's max_num_seqs: the most requests running at once.
	MaxNumSeqs int `json:"max_num_seqs"`
}

// ProfileLlama31_8B_A100 models Llama-3.1-8B (bf16, TP 1) served by vLLM V1 on one NVIDIA
// A100-SXM4-80GB, calibrated to published figures:
//
//   - Linear layers: Vidur's per-operator profile of Meta-Llama-3-8B on A100, TP 1 (microsoft/vidur,
//     data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv; Llama-3.1-8B has the same
//     shapes) gives, per decoder layer, the sum of the medians of the norms, QKV/output
//     projections, rotary embedding, gated MLP and residual add: 0.315 ms at 16 tokens, 12.98 ms at
//     6,144 tokens and 67.5 ms at 32,768 tokens, i.e. 10.1 ms, 415 ms and 2.16 s for the 32
//     layers. StepMs 9 + PerTokenUs 66 reproduces the three within 2 % (10.1, 414.5, 2,171.7 ms).
//   - Prefill attention: 4 × 32 layers × 4,096 (32 heads × 128) = 524,288 FLOP per (query, key)
//     pair; the FlashAttention-2 paper reports its forward pass at 50–73 % of the A100's
//     312 TFLOP/s peak, and 190 TFLOP/s (61 %) is assumed, hence 2.76 ns per pair: a cold
//     8,192-token prompt spends 93 ms in attention beside 550 ms in the linear layers.
//   - Decode attention: each context token holds 32 layers × 2 × 8 KV heads × 128 × 2 bytes =
//     128 KiB; reading it at 80 % of the A100-80GB's 2,039 GB/s takes 80 ns. A decode step of 16
//     requests with 14k-token contexts takes 9 + 1.1 + 17.9 = 28 ms.
//   - Scheduler: vLLM V1's OpenAI-server defaults for an A100 (vllm/engine/arg_utils.py batch
//     defaults: GPUs with ≥ 70 GiB other than the A100 get 8,192 tokens and 1,024 sequences, the
//     A100 and smaller GPUs 2,048 and 256).
//
// With 16-token blocks, 20,000 KV blocks (320k tokens × 128 KiB = 39 GiB) fit the memory that
// remains beside the 16 GB of weights at gpu_memory_utilization 0.8.
var ProfileLlama31_8B_A100 = StepProfile{
	Name:                "llama-3.1-8b-a100-80gb",
	Description:         "Llama-3.1-8B bf16 on 1x A100-SXM4-80GB, vLLM V1 defaults; linear layers fitted to Vidur's Meta-Llama-3-8B A100 profile, FlashAttention-2 at 190 TFLOP/s, KV reads at 80% of 2,039 GB/s",
	StepMs:              9,
	PerTokenUs:          66,
	AttentionPairNs:     2.76,
	ContextTokenNs:      80,
	MaxNumBatchedTokens: 2048,
	MaxNumSeqs:          256,
}

// DefaultProfile is the profile [EngineVLLM] uses when [Config.Profile] is the zero value.
var DefaultProfile = ProfileLlama31_8B_A100

// profiles are the presets ProfileByName knows.
var profiles = map[string]StepProfile{ProfileLlama31_8B_A100.Name: ProfileLlama31_8B_A100}

// ProfileNames returns the preset profile names, sorted.
func ProfileNames() []string {
	out := make([]string, 0, len(profiles))
	for n := range profiles {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// ProfileByName returns the preset profile called name, or an error listing the presets.
func ProfileByName(name string) (StepProfile, error) {
	if p, ok := profiles[name]; ok {
		return p, nil
	}
	return StepProfile{}, fmt.Errorf("enginesim: unknown step profile %q (presets: %s)", name, strings.Join(ProfileNames(), ", "))
}

// validate checks that every time is finite and ≥ 0 and the limits are ≥ 1, naming the field.
func (p StepProfile) validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"StepMs", p.StepMs}, {"PerTokenUs", p.PerTokenUs}, {"AttentionPairNs", p.AttentionPairNs}, {"ContextTokenNs", p.ContextTokenNs},
	} {
		if math.IsNaN(f.v) || math.IsInf(f.v, 0) || f.v < 0 {
			return fmt.Errorf("enginesim: step profile %q: %s %v must be a finite number ≥ 0", p.Name, f.name, f.v)
		}
	}
	if p.MaxNumBatchedTokens < 1 {
		return fmt.Errorf("enginesim: step profile %q: MaxNumBatchedTokens %d must be ≥ 1", p.Name, p.MaxNumBatchedTokens)
	}
	if p.MaxNumSeqs < 1 {
		return fmt.Errorf("enginesim: step profile %q: MaxNumSeqs %d must be ≥ 1", p.Name, p.MaxNumSeqs)
	}
	if p.StepMs+p.PerTokenUs == 0 {
		return fmt.Errorf("enginesim: step profile %q: StepMs and PerTokenUs are both 0, so a step would take no time", p.Name)
	}
	return nil
}

// StepWork is what one scheduler step computes, the input of [StepProfile.StepTime].
type StepWork struct {
	// PrefillTokens is the number of prompt (or recomputed) tokens the step prefills.
	PrefillTokens int
	// AttentionPairs is Σ over prefill chunks of q·(c + (q+1)/2): new tokens times the tokens each
	// attends to.
	AttentionPairs float64
	// DecodeRequests is the number of requests that decode one token in the step.
	DecodeRequests int
	// DecodeContextTokens is the sum of the KV-cache lengths those requests read, tokens.
	DecodeContextTokens int
}

// addChunk adds a prefill chunk of q new tokens after c tokens already computed.
func (w *StepWork) addChunk(q, c int) {
	w.PrefillTokens += q
	w.AttentionPairs += float64(q) * (float64(c) + float64(q+1)/2)
}

// StepTime returns the simulated duration of a step doing w (see [StepProfile]).
func (p StepProfile) StepTime(w StepWork) time.Duration {
	ms := p.StepMs +
		p.PerTokenUs*float64(w.PrefillTokens+w.DecodeRequests)/1e3 +
		p.AttentionPairNs*w.AttentionPairs/1e6 +
		p.ContextTokenNs*float64(w.DecodeContextTokens)/1e6
	return time.Duration(ms * float64(time.Millisecond))
}
