package picker

import "github.com/kvepp/kvepp/kvindex"

// KV hint envelope constants (selection-service.md §7.7).
const (
	KVHintProtocolVersion = "0.1"
	KVHintActionID        = "a1"
	KVHintActionFetch     = "kv.fetch"
	KVHintActionVersion   = "1.0"
)

// kvHint builds the kv_hint of a booking (selection-service.md §7.7), or nil. All must hold:
//  1. the partition's index is local and event-driven (no approximate primary);
//  2. the chosen worker registered router_hint_worker_type;
//  3. another schedulable worker of the same router_hint_worker_type, not a state_agent_v2
//     source, holds a strictly longer device prefix than the chosen candidate — per worker its
//     longest-matching rank (lowest rank on ties) counts;
//  4. that source advertises router_hint_source_control_endpoints for that rank.
//
// Among sources the longest match wins, then the lowest (worker_id, dp_rank). The payload's
// block_hashes are the source's external block hashes for request blocks 0..n-1 as recorded by
// the index (root-aligned). Caller holds p.mu (the tiers of the selection are still in p.sc).
func (s *Service) kvHint(p *partition, ch *choice, selectionID string) *KVHint {
	v := ch.view
	if v.index == nil || v.index.events == nil {
		return nil
	}
	chosen := v.workers[v.owner[ch.pos]]
	if chosen.hintType == "" {
		return nil
	}
	tiers := p.sc.tiers
	floor := tiers[ch.pos].device
	var (
		src    *schedWorker
		srcRk  uint32
		srcLen uint32
	)
	for _, w := range v.workers {
		if w.id == chosen.id || w.hintType != chosen.hintType || w.stateAgent {
			continue
		}
		best, rank := uint32(0), uint32(0)
		for r := uint32(0); r < w.size; r++ {
			if d := tiers[w.firstCand+int32(r)].device; d > best {
				best, rank = d, w.start+r
			}
		}
		if best <= floor || best < srcLen || (best == srcLen && src != nil) {
			// workers are sorted by id, so on a tie the earlier (lower id) source stays.
			continue
		}
		if w.hintSources[rank] == "" {
			continue
		}
		src, srcRk, srcLen = w, rank, best
	}
	if src == nil {
		return nil
	}
	hashes := v.index.events.ExternalHashes(kvindex.Candidate{WorkerID: src.id, DPRank: srcRk}, ch.np.local, int(srcLen))
	if len(hashes) == 0 {
		return nil
	}
	return &KVHint{
		ProtocolVersion: KVHintProtocolVersion,
		MessageID:       selectionID,
		Actions: []KVHintAction{{
			ActionID:      KVHintActionID,
			ActionType:    KVHintActionFetch,
			ActionVersion: KVHintActionVersion,
			Payload:       KVFetchAction{SourceControlEndpoint: src.hintSources[srcRk], BlockHashes: hashes},
		}},
	}
}
