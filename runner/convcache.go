package runner

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvepp/kvepp/extproc/tokenizer"
)

// Conversation-cache metrics (kvepp_conversation_cache_*): the memory the cache holds against its
// bound (DYN_EPP_CONVERSATION_CACHE_BYTES) and how often it serves a chat.
var (
	descConvBytes = prometheus.NewDesc("kvepp_conversation_cache_bytes",
		"Memory held by the local tokenizers' conversation cache (keys, token ids, texts), bytes.", nil, nil)
	descConvLimit = prometheus.NewDesc("kvepp_conversation_cache_limit_bytes",
		"Bound of the conversation cache (DYN_EPP_CONVERSATION_CACHE_BYTES), bytes.", nil, nil)
	descConvEntries = prometheus.NewDesc("kvepp_conversation_cache_entries",
		"Conversation prefixes held by the conversation cache.", nil, nil)
	descConvLookups = prometheus.NewDesc("kvepp_conversation_cache_lookups_total",
		"Chat tokenizations by conversation-cache result: hit (an earlier turn's prefix reused), miss (tokenized from scratch, then cached), bypass (template or tokenizer without a proof, images, continue_final_message).",
		[]string{"result"}, nil)
	descConvHitRatio = prometheus.NewDesc("kvepp_conversation_cache_hit_ratio",
		"Hits over hits plus misses since start (0 before any lookup).", nil, nil)
	descConvReused = prometheus.NewDesc("kvepp_conversation_cache_reused_tokens_total",
		"Prompt tokens taken from the conversation cache instead of being rendered and encoded again.", nil, nil)
	descConvEvictions = prometheus.NewDesc("kvepp_conversation_cache_evictions_total",
		"Entries evicted to keep the conversation cache within its bound.", nil, nil)
)

// conversationCacheCollector exports a ConversationCache's Stats.
type conversationCacheCollector struct{ c *tokenizer.ConversationCache }

var _ prometheus.Collector = conversationCacheCollector{}

// Describe implements prometheus.Collector.
func (conversationCacheCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descConvBytes, descConvLimit, descConvEntries, descConvLookups, descConvHitRatio, descConvReused, descConvEvictions} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (cc conversationCacheCollector) Collect(ch chan<- prometheus.Metric) {
	st := cc.c.Stats()
	ch <- prometheus.MustNewConstMetric(descConvBytes, prometheus.GaugeValue, float64(st.Bytes))
	ch <- prometheus.MustNewConstMetric(descConvLimit, prometheus.GaugeValue, float64(st.MaxBytes))
	ch <- prometheus.MustNewConstMetric(descConvEntries, prometheus.GaugeValue, float64(st.Entries))
	ch <- prometheus.MustNewConstMetric(descConvLookups, prometheus.CounterValue, float64(st.Hits), "hit")
	ch <- prometheus.MustNewConstMetric(descConvLookups, prometheus.CounterValue, float64(st.Misses), "miss")
	ch <- prometheus.MustNewConstMetric(descConvLookups, prometheus.CounterValue, float64(st.Bypassed), "bypass")
	ratio := 0.0
	if n := st.Hits + st.Misses; n > 0 {
		ratio = float64(st.Hits) / float64(n)
	}
	ch <- prometheus.MustNewConstMetric(descConvHitRatio, prometheus.GaugeValue, ratio)
	ch <- prometheus.MustNewConstMetric(descConvReused, prometheus.CounterValue, float64(st.ReusedTokens))
	ch <- prometheus.MustNewConstMetric(descConvEvictions, prometheus.CounterValue, float64(st.Evictions))
}
